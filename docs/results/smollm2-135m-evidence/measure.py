"""Issue 76: does each answer's top evidence source lie in the gold SQuAD sentence? On the grounded SQuAD-built
answers of a split (answers.py: ``copied`` and ``restated``), halwatch's evidence from attention (the shipped
default, as ``halwatch score --evidence attention`` gives it), from relevance (``--evidence relevance``), the
lexical baseline, and ContextCite (run by contextcite_run.py in its own environment, on the same answers and
context sentences, its results read from contextcite.jsonl when present).

An answer's top source is the heaviest source over its sentences; it is right when it holds the first character of
SQuAD's gold answer. A sentence the default flags has no sources: for the answer, a miss (the flag is reported
beside). ``--answers generated``: the dialogue replies rated supported (answers.py), right when the top source starts
in the gold sentence. Writes answers.jsonl (answers-generated.jsonl: the answers and their context sentences, for
ContextCite) and test.json (or --output).

    .venv/bin/python docs/results/smollm2-135m-evidence/measure.py --split test [--relevance N] [--output F]
        [--answers squad|generated] [--answers-only]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from answers import copied, generated, lexical, long_contexts, restated  # noqa: E402

import halwatch  # noqa: E402
from halwatch.eval.protocols import source_commit  # noqa: E402
from halwatch.sentences import sentence_ranges  # noqa: E402


def top_source(result) -> tuple[int, int] | None:
    sources = [s for sentence in result.evidence for s in sentence.sources]
    if not sources:
        return None
    best = max(sources, key=lambda s: s.weight)
    return best.start, best.end


def holds(found, row) -> bool:
    """Whether a top source is right: it holds the gold answer's first character (SQuAD rows) or starts inside the
    gold sentence (``generated`` rows, whose gold is a whole sentence that the context's cut may part in two)."""
    if found is None:
        return False
    if row["kind"] == "generated":
        return row["gold"][0] <= found[0] < row["gold"][1]
    return found[0] <= row["answer_start"] < found[1]


def run(hw, rows: list[dict], mode: str) -> tuple[list[dict], float]:
    """Each row's result with evidence in ``mode``, one answer per call; seconds per answer."""
    t0 = time.perf_counter()
    results = [hw.check(**_record(r), evidence=mode) for r in rows]
    return results, (time.perf_counter() - t0) / max(1, len(rows))


def _record(row) -> dict:
    s = row["sample"]
    return {"id": s.id, "context": s.context, "question": s.question, "response": s.response}


def shares(rows: list[dict], hits: dict[str, list]) -> dict:
    """Per kind of answer (and the restated ones whose other words the gold sentence mostly lacks, and the answers
    ContextCite was run on): the share of answers each method's top source is right for."""
    cited = set(i for i, h in enumerate(hits.get("ContextCite", [])) if h is not None)
    kinds = {"phrase": lambda r: r["kind"] == "phrase", "sentence": lambda r: r["kind"] == "sentence",
             "copied (phrase + sentence)": lambda r: r["kind"] in ("phrase", "sentence"),
             "restated": lambda r: r["kind"] == "restated",
             "long contexts (windows)": lambda r: r["kind"] == "long",
             "restated, at most half of the other words in the gold sentence":
                 lambda r: r["kind"] == "restated" and r["overlap"] <= 0.5,
             "generated": lambda r: r["kind"] == "generated",
             "generated, at most half of their words in the gold sentence":
                 lambda r: r["kind"] == "generated" and r["overlap"] <= 0.5}
    for kind in ("phrase", "sentence", "restated", "generated") if cited else ():
        kinds[f"{kind}, the answers ContextCite was run on"] = lambda r, kind=kind: r["kind"] == kind
    out = {}
    for name, keep in kinds.items():
        idx = [i for i, r in enumerate(rows) if keep(r) and (i in cited or "ContextCite was run" not in name)]
        if not idx:
            continue
        out[name] = {"answers": len(idx), "mean overlap": round(float(np.mean([rows[i]["overlap"] for i in idx])), 3),
                     "sentences per context": round(float(np.mean([rows[i]["units"] for i in idx])), 2)}
        for method, hit in hits.items():
            got = [hit[i] for i in idx if hit[i] is not None]
            if got:
                out[name][method] = round(float(np.mean(got)), 3)
                if len(got) < len(idx):
                    out[name][method + " (answers)"] = len(got)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", default="test", choices=("dev", "test"))
    parser.add_argument("--relevance", type=int, default=0, help="answers (the first of each kind) for relevance")
    parser.add_argument("--output", default="test.json", help="file name in this folder")
    parser.add_argument("--long", type=int, default=40, help="answers put among other passages (windows)")
    parser.add_argument("--answers", default="squad", choices=("squad", "generated"),
                        help="the SQuAD-built answers, or the dialogue replies rated supported (answers.py)")
    parser.add_argument("--answers-only", action="store_true", help="write the answers file for ContextCite and stop")
    args = parser.parse_args()
    if args.answers == "generated":
        rows = generated(args.split)
    else:
        rows = copied(args.split) + restated(args.split, 10_000)
        rows += [x for kind in ("sentence", "restated")
                 for x in long_contexts([r for r in rows if r["kind"] == kind], args.long // 2, rows)]
    for r in rows:
        r["units"] = len(sentence_ranges(r["sample"].context))
    with open(HERE / ("answers.jsonl" if args.answers == "squad" else "answers-generated.jsonl"), "w",
              encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({**_record(r), "kind": r["kind"], "answer_start": r["answer_start"],
                                "gold": r["gold"], "overlap": r["overlap"],
                                "units": sentence_ranges(r["sample"].context)}) + "\n")
    if args.answers_only:
        return
    hw = halwatch.load()
    attention, seconds = run(hw, rows, "attention")
    hits = {"lexical": [holds(lexical(r), r) for r in rows],
            "halwatch attention": [holds(top_source(res), r) for res, r in zip(attention, rows)],
            "flagged (no source)": [top_source(res) is None for res in attention]}
    timing = {"halwatch attention, s/answer (one per call, whole path)": round(seconds, 4),
              "windows per long answer": round(float(np.mean([r.windows for r, row in zip(attention, rows)
                                                                if row["kind"] == "long"] or [0])), 2)}
    if args.relevance:
        picked = [i for kind in ("phrase", "sentence", "restated", "generated")
                  for i in [j for j, r in enumerate(rows) if r["kind"] == kind][:args.relevance]]
        found, seconds = run(hw, [rows[i] for i in picked], "relevance")
        hits["halwatch relevance"] = [None] * len(rows)
        for i, res in zip(picked, found):
            hits["halwatch relevance"][i] = holds(top_source(res), rows[i])
        timing["halwatch relevance, s/answer"] = round(seconds, 4)
    cc_path = HERE / "contextcite.jsonl"
    if cc_path.exists():
        by_id = {c["id"]: c for c in map(json.loads, cc_path.read_text().splitlines())}
        hits["ContextCite"] = [holds(tuple(by_id[r["sample"].id]["top"]), r) if r["sample"].id in by_id else None
                               for r in rows]
        ran = [by_id[r["sample"].id]["seconds"] for r in rows if r["sample"].id in by_id]
        if ran:
            timing["ContextCite, s/answer"] = round(float(np.mean(ran)), 4)
    out = {"commit": source_commit(), "split": args.split, "answers": args.answers,
           "dtype": hw.pipeline.scorer.model.dtype,
           "top1_in_gold_sentence": shares(rows, hits), "seconds": timing}
    print(json.dumps(out, indent=1))
    (HERE / args.output).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
