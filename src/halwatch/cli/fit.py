"""``halwatch fit``: fit a detector on labelled data (``--into`` a routed artifact's parts, ``--map-from``
another scoring model's Lookback Lens) and save its artifact."""

from __future__ import annotations

from halwatch.cli.options import (
    SET_HELP,
    add_labelled_options,
    add_scorer_options,
    encode_all,
    labelled_input,
    read_input,
    scorer_from,
)
from halwatch.errors import InputError
from halwatch.progress import note


def add_parser(sub) -> None:
    from halwatch.detectors.calibration import CALIBRATIONS

    p = sub.add_parser("fit", help="fit a detector on labelled JSONL data and save its artifact")
    p.add_argument("--detector", required=True, help="method name (toha, lookback-lens, perplexity, ...)")
    add_labelled_options(p)
    p.add_argument("--output", required=True, help="artifact file to write (JSON)")
    p.add_argument("--calibration", choices=CALIBRATIONS, default=None,
                   help="default platt (with --into: the artifact's)")
    p.add_argument("--describe", help="what the data is, recorded in the artifact (default: the input path; with "
                        "--datasets it goes before the datasets and split, which are always recorded)")
    p.add_argument("--map-from", metavar="ARTIFACT",
                   help="lookback-lens only: no fitting; map this artifact's detector (fitted with another scoring "
                        "model) onto --model's heads with a linear map fitted on --input (labels not needed)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help=SET_HELP)
    p.add_argument("--into", metavar="NAME|FILE",
                   help="routed only: fit a part for each task of the data, with this routed artifact's settings, "
                        "scoring model and precision, and write the artifact with them in place of its parts of "
                        "those tasks (its other parts kept); e.g. --into default --datasets rotowire")
    p.add_argument("--skip-invalid", action="store_true", help="report and skip bad records instead of stopping")
    add_scorer_options(p)
    p.set_defaults(func=cmd_fit)


def cmd_fit(args) -> int:
    from halwatch.detectors import create_detector, parse_settings

    if args.into:
        return _fit_into(args)
    scorer = scorer_from(args)
    if args.map_from:
        samples = read_input(args.input, args.skip_invalid, args.task)
        return _fit_mapped(args, scorer, encode_all(scorer, samples, args.skip_invalid)[0])
    samples, describe = labelled_input(args, scorer)
    detector = create_detector(args.detector, scorer=scorer, calibration=args.calibration or "platt",
                               **parse_settings(args.set))
    detector.fit(samples, progress=True)
    detector.fitted_on["data"] = describe
    detector.save(args.output)
    note(f"fitted {detector.name} on {len(samples)} samples "
          f"({detector.fitted_on['n_hallucinated']} hallucinated) -> {args.output}")
    parts = getattr(detector, "parts", None) or {"": detector}
    if "to_fallback" in detector.fitted_on:
        note(f"too few answers for a part of their own (judged by the {detector.settings['fallback']} part): "
             + ", ".join(f"{task} ({row['n']})" for task, row in detector.fitted_on["to_fallback"].items()))
    for task, part in parts.items():
        _fit_notes(part, f"{task} part ({part.fitted_on['n']} answers): " if task else "")
    return 0


def _fit_into(args) -> int:
    """``halwatch fit --detector routed --into ARTIFACT``: a part fitted for each task of the data, with the
    artifact's own settings, scoring model, input mode, token cap and precision, put into a copy of the artifact in
    place of its part of that task (:meth:`~halwatch.detectors.routed.Routed.with_parts`)."""
    from halwatch.detectors import read_artifact
    from halwatch.detectors.routed import MIN_PER_LABEL, Routed
    from halwatch.sample import task_of

    if args.detector != "routed":
        raise InputError(f"--into puts new parts into a routed detector: give --detector routed, not {args.detector}")
    if args.set or args.map_from:
        raise InputError("--into fits the parts with the artifact's own settings: leave out --set and --map-from")
    artifact = read_artifact(args.into)
    if artifact.get("detector") != "routed":
        raise InputError(f"--into {args.into}: a {artifact.get('detector')} artifact has no parts; give a routed one")
    method = artifact.get("calibration", {}).get("method", "platt")
    if args.calibration not in (None, method):
        raise InputError(f"--into fits the parts with the artifact's calibration ({method}): leave out --calibration")
    fitted_dtype = artifact.get("dtype", "float32")  # (artifacts from before precision was recorded: float32)
    if args.dtype == "auto":  # a part joins an artifact in the precision the artifact's other parts were fitted in
        args.dtype = fitted_dtype
    scorer = scorer_from(args, artifact)
    mine, theirs = scorer.identity(), {**artifact, "dtype": fitted_dtype}
    differ = [k for k in mine if mine[k] != theirs.get(k)]
    if differ:  # checked before the artifact is loaded for this scorer (which would advise a whole refit)
        raise InputError(f"--into {args.into} was fitted with " + ", ".join(f"{k} {theirs.get(k)}" for k in differ)
                         + "; its new parts must be too (" + ", ".join(f"here {k} {mine[k]}" for k in differ) + ")")
    base = Routed.from_dict(artifact, scorer=scorer)
    samples, describe = labelled_input(args, scorer)
    counts: dict[str, list[int]] = {}
    for s in samples:
        counts.setdefault(task_of(s), [0, 0])[int(s.label)] += 1
    few = {task: c for task, c in counts.items() if min(c) < MIN_PER_LABEL}
    if few:
        raise InputError(f"a part needs at least {MIN_PER_LABEL} grounded and {MIN_PER_LABEL} hallucinated answers "
                         "of its task: " + "; ".join(f"{task} has {c[0]} and {c[1]}" for task, c in few.items()))
    fresh = Routed(scorer=scorer, calibration=base.calibrator.method, decision=base.decision_rule, prior=base.prior,
                   **{**base.settings, "fallback": min(counts)})
    fresh.fit(samples, progress=True)
    found = base.with_parts(fresh, describe)
    base.save(args.output)
    note(f"fitted the {', '.join(sorted(fresh.parts))} part(s) of {base.name} on {len(samples)} samples "
         f"({fresh.fitted_on['n_hallucinated']} hallucinated) into {args.into}: "
         + "; ".join(f"{how} {', '.join(tasks)}" for how, tasks in found.items() if tasks)
         + f"; kept {', '.join(sorted(set(base.parts) - set(fresh.parts))) or 'none'} -> {args.output}")
    if base.settings["fallback"] in found["replaced"]:
        note(f"the new {base.settings['fallback']} part is the fallback: it also judges the tasks without a part")
    for task, part in fresh.parts.items():
        _fit_notes(part, f"{task} part ({part.fitted_on['n']} answers): ")
    return 0


def _fit_notes(detector, head: str) -> None:
    """What ``halwatch fit`` prints of a fitted detector (or of one part of a routed one): each dataset's
    out-of-fold operating point and the span rule."""
    by_dataset = detector.fitted_on.get("by_dataset")
    if by_dataset or head:
        def rate(value):
            return "-" if value is None else f"{value:.2f}"

        note(f"{head}at the threshold {detector.threshold:.3f} ({detector.decision_rule})" + (
            ", out of fold: " + "; ".join(f"{name or 'unnamed'} FPR {rate(row['fpr'])} TPR {rate(row['tpr'])}"
                                          for name, row in by_dataset.items()) if by_dataset else ""))
    span_fit = detector.fitted_on.get("span_fit")
    if span_fit:
        from halwatch.detectors.spans import describe_rule

        by_gap = ", ".join(f"{gap}: {f1:.3f}" for gap, f1 in span_fit["by_gap"].items())
        confidence = span_fit.get("confidence") or {}
        note(f"{head}span rule: {describe_rule(detector.span.rule)}; character span F1 on the held-out training "
             f"answers {span_fit['f1']:.3f} (best with each gap: {by_gap}); a span in "
             f"{span_fit['grounded_with_span']:.0%} of the grounded ones; span confidence fitted on "
             f"{confidence.get('n_spans', 0)} spans, {confidence.get('hit_share') or 0:.0%} of them on human spans"
             + ("" if detector.span.calibration else " (not calibrated: spans of one outcome only)"))


def _fit_mapped(args, scorer, samples) -> int:
    """``fit --map-from ARTIFACT``: carry a fitted Lookback Lens to another scoring model (no labels needed)."""
    from halwatch.detectors import load_detector
    from halwatch.detectors.attention import LookbackLens

    source = load_detector(args.map_from)
    if not isinstance(source, LookbackLens) or args.detector != source.name:
        raise InputError(f"--map-from needs a lookback-lens artifact and --detector lookback-lens "
                         f"(got {source.name} and {args.detector})")
    mapped = LookbackLens.mapped_from(source, scorer, samples, progress=True)
    mapped.fitted_on["map_data"] = args.describe or str(args.input)
    mapped.save(args.output)
    note(f"mapped {source.name} from {source.identity.get('scoring_model')} to {scorer.model.name} on "
          f"{len(samples)} samples -> {args.output}")
    return 0
