"""``halwatch generate``: answer prompts with the scoring model, greedy or guided by a detector."""

from __future__ import annotations

import json
import logging

from halwatch.cli.options import add_question_options, add_scorer_options, scorer_from
from halwatch.errors import InputError
from halwatch.progress import note

log = logging.getLogger("halwatch")


def add_parser(sub) -> None:
    """Answer one prompt (--prompt, or --context and --question) or every record of a JSONL file (--input/--output,
    resumed by id) with the scoring model. With --guide, each step samples --candidates continuations of --chunk
    tokens and keeps the one the detector finds least hallucinated (Lookback Lens Guided Decoding); without it,
    greedy decoding. Records whose meta has SQuAD answers are labelled with the same-model labelling rule."""
    p = sub.add_parser("generate", help="answer prompts with the scoring model, greedy or guided by a detector",
                       description=add_parser.__doc__)
    p.add_argument("--guide", help="lookback, toha (the shipped artifacts for the input mode) or an artifact file "
                                   "of any detector; default: none (greedy)")
    p.add_argument("--input", help="JSONL with prompt (or context and question) per record")
    p.add_argument("--output", help="JSONL to write, or to resume")
    p.add_argument("--limit", type=int, help="only the first N records of --input")
    add_question_options(p)
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
    add_scorer_options(p, mode_default="chat (with an artifact file: the artifact's)")
    p.set_defaults(func=cmd_generate)


#: ``--guide`` short names: the shipped artifacts of these methods for the input mode (``NAME`` or ``NAME-chat``).
GUIDES = {"lookback": "lookback-lens", "toha": "toha"}


def _guide(args):
    """The guide detector and the scorer it runs on (greedy decoding: no detector)."""
    from halwatch.detectors import load_detector, read_artifact

    mode = args.input_mode
    if not args.guide:
        return None, scorer_from(args, input_mode=mode or "chat")
    name = args.guide
    if name in GUIDES:
        mode = mode or "chat"
        name = GUIDES[name] + ("-chat" if mode == "chat" else "")
    artifact = read_artifact(name)  # an artifact file's own input mode unless --input-mode is given
    scorer = scorer_from(args, artifact, input_mode=mode)
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
