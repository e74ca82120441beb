"""``halwatch data``: export datasets to the generic JSONL format, or generate same-model data."""

from __future__ import annotations

from halwatch.cli.options import add_scorer_options, scorer_from
from halwatch.progress import note


def add_parser(sub) -> None:
    from halwatch.data.ragtruth import GENERATORS, QUALITIES, SPLITS

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
    add_scorer_options(pg, mode_default="chat")
    p.set_defaults(func=cmd_data)


def cmd_data(args) -> int:
    if args.data_cmd == "generate":
        from halwatch.data.generate import generate_squad

        scorer = scorer_from(args, input_mode=args.input_mode or "chat")
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
