"""``halwatch calibrate``: a fitted detector's probabilities and threshold set on your own labelled answers, or
restated for a share of hallucinated answers (``--prior``)."""

from __future__ import annotations

import argparse

from halwatch.cli.options import (
    add_labelled_options,
    add_scorer_options,
    add_windows_option,
    labelled_input,
    scorer_from,
)
from halwatch.errors import InputError
from halwatch.progress import note


def add_parser(sub) -> None:
    """Score 50-500 labelled answers of your own with a fitted detector and write a copy of it whose probabilities are
    calibrated on them (Platt scaling; they then assume your share of hallucinated answers) and whose threshold
    holds the false-positive rate you ask for (split-conformal; without --target-fpr, the best F1 on your answers).
    Without labels, --prior restates the probabilities for a share of hallucinated answers you state or that is
    estimated from your answers, keeping every verdict. `halwatch score --detector` and `halwatch serve --detector`
    load the result."""
    p = sub.add_parser("calibrate", help="set a fitted detector's probabilities and threshold on your own labelled "
                                         "answers",
                       description=add_parser.__doc__)
    p.add_argument("--detector", default="default", help="shipped artifact name or artifact file (default: default)")
    add_labelled_options(p)
    p.add_argument("--output", required=True, help="artifact file to write (JSON)")
    p.add_argument("--target-fpr", type=float, metavar="A",
                   help="the share of grounded answers you accept to see flagged, e.g. 0.1")
    p.add_argument("--prior", type=_share, metavar="SHARE|estimate",
                   help="instead of calibrating on labels: let the probabilities assume this share of hallucinated "
                        "answers (e.g. 0.25), or the share estimated from the unlabelled answers of --input or "
                        "--datasets ('estimate'); verdicts and spans stay as they are (with --task, only that "
                        "task's part)")
    p.add_argument("--describe", help="what the data is, recorded in the artifact (default: the input path; with "
                        "--datasets it goes before the datasets and split, which are always recorded)")
    p.add_argument("--skip-invalid", action="store_true", help="report and skip bad records instead of stopping")
    add_scorer_options(p, defaults_from_artifact=True)
    add_windows_option(p)
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args) -> int:
    from halwatch.detectors import load_detector, read_artifact

    artifact = read_artifact(args.detector)
    if args.prior is not None:
        return _restate(args, artifact)
    scorer = scorer_from(args, artifact)
    samples, describe = labelled_input(args, scorer)  # its records are checked before the model loads
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
        scorer = scorer_from(args, artifact)
        samples, describe = labelled_input(args, scorer, labelled=False)
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
