"""``halwatch score``: score a JSONL file or one answer (on Ray with ``--ray``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from halwatch.cli.options import (
    add_min_span_confidence,
    add_question_options,
    add_ray_options,
    add_scorer_options,
    add_task_option,
    add_windows_option,
    ray_options,
    read_input,
    scorer_from,
    scorer_options,
)
from halwatch.errors import InputError
from halwatch.progress import note

log = logging.getLogger("halwatch")


def add_parser(sub) -> None:
    p = sub.add_parser("score", help="score responses: probability of hallucination, verdict and flagged spans",
                       description="Score a JSONL file (--input/--output) or one answer (--response with --prompt "
                                   "or --context and --question); one output object per response.")
    p.add_argument("--input", help="generic JSONL file (fields: id, prompt | context [+ question] [+ task], "
                                   "response)")
    p.add_argument("--output", help="where to write the results (JSONL; - for standard output)")
    p.add_argument("--detector", default="default",
                   help="shipped artifact name or artifact file (default: the shipped 'default')")
    add_question_options(p)
    p.add_argument("--response", help="the answer to score")
    p.add_argument("--id", default="1", help="id of the single answer (default 1)")
    add_task_option(p)
    add_min_span_confidence(p)
    p.add_argument("--evidence", choices=("attention", "relevance"), default=None,
                   help="give each answer sentence its sources in the context: 'attention' from the pass (a few "
                        "percent more time) or 'relevance', exact (a backward pass per response token); default: "
                        "none")
    p.add_argument("--skip-invalid", action="store_true", help="report and skip bad records instead of stopping")
    add_scorer_options(p, defaults_from_artifact=True)
    add_windows_option(p)
    add_ray_options(p, "score")
    p.set_defaults(func=cmd_score)


def _score_on_ray(args, artifact: dict) -> int:
    """``halwatch score --input F --output O --ray``: verdicts appended to O as they arrive; ids already in O are
    skipped; failed records are reported with their ids (and listed in O.errors.jsonl), the others kept."""
    from halwatch.data.jsonl import sample_record, write_jsonl
    from halwatch.scale import score_records

    if not args.input or args.output in (None, "-"):
        raise InputError("--ray scores a file: give --input FILE and --output FILE (appended to, and resumed)")
    samples = read_input(args.input, args.skip_invalid, args.task)  # prompts rendered here, by --task
    stats = score_records([sample_record(s) for s in samples], args.output, detector=artifact,
                          scorer_options=scorer_options(args), progress=True, evidence=args.evidence,
                          **ray_options(args))
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
    from halwatch.detectors.spans import check_confidence
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
        samples = read_input(args.input, args.skip_invalid, args.task)
    pipeline = Pipeline(load_detector(artifact, scorer=scorer_from(args, artifact)))
    _, answers = encoded(pipeline, samples, args.skip_invalid, on_skip=lambda err: log.warning("skipped %s", err))
    records = (r.to_dict() for r in pipeline.stream(answers, progress=not single, evidence=args.evidence))
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
