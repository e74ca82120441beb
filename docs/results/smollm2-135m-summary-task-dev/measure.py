"""Issue 75, "summaries judged as summaries": a summary sent with its instruction as the question. Before, such a
record was rendered in the QA template and judged by the ``qa`` part; now the question is read as a summary request
(:func:`halwatch.sample.asks_for_summary`) and the record is rendered as a query-focused summary and judged by the
``summary`` part. On the dev split of each summary set, with the shipped default, three renderings of every summary:

- ``plain``: the context alone (the summary template, as the summary part was fitted);
- ``as qa``: the context and an instruction as the question, in the QA template, judged by the ``qa`` part (what
  halwatch did before the inference; ``task="qa"`` forces it now);
- ``inferred``: the same record with no task named (the summary part, the query-focused summary template).

The instruction of each summary is one of four, in turn. Per set and rendering: AUROC, the false- and true-positive
rates at the part's threshold, and against ``plain`` the median change of the probability and the share of verdicts
that flip. BUMP was never trained on; XSum's and SummEdits' dev answers are among the default's training answers
(train+dev) in the plain rendering only. FaithBench is all test split: not read here.

    .venv/bin/python docs/results/smollm2-135m-summary-task-dev/measure.py [--limit N] [--output F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import halwatch
from halwatch.data.splits import split_of
from halwatch.eval.datasets import load_dataset
from halwatch.eval.metrics import evaluate
from halwatch.eval.protocols import source_commit

HERE = Path(__file__).resolve().parent
SETS = ("bump", "xsum-hallucination", "summedits")
INSTRUCTIONS = ("Summarize the article.", "Write a short summary of the text above.", "Give a brief summary.",
                "TL;DR")


def renderings(sample, k: int) -> dict[str, dict]:
    base = {"id": sample.id, "context": sample.context, "response": sample.response}
    asked = {**base, "question": INSTRUCTIONS[k % len(INSTRUCTIONS)]}
    return {"plain": base, "as qa": {**asked, "task": "qa"}, "inferred": asked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=None, help="at most this many answers per set")
    parser.add_argument("--output", default=str(HERE / "dev.json"))
    args = parser.parse_args()
    hw = halwatch.load()
    rows = {"commit": source_commit(), "instructions": INSTRUCTIONS, "sets": {}}
    for name in SETS:
        samples = [s for s in load_dataset(name)[0] if split_of(s) == "dev" and not s.question][:args.limit]
        labels = np.array([s.label for s in samples])
        found = {}
        for how in ("plain", "as qa", "inferred"):
            results = hw.check_many([renderings(s, k)[how] for k, s in enumerate(samples)], batch_size=1,
                                    progress=True)
            found[how] = results
        plain = np.array([r.score for r in found["plain"]])
        table = {}
        for how, results in found.items():
            probs = np.array([r.score for r in results])
            m = evaluate(labels, probs, np.array([r.threshold for r in results]))
            table[how] = {"n": len(results), "task": sorted({r.task for r in results}),
                          "auroc": round(m["auroc"], 4), "fpr": round(m["fpr"], 4), "tpr": round(m["tpr"], 4),
                          "median_change_from_plain": round(float(np.median(np.abs(probs - plain))), 4),
                          "flipped_from_plain": round(float(np.mean([a.hallucinated != b.hallucinated for a, b in
                                                                     zip(results, found["plain"])])), 4)}
        rows["sets"][name] = {"n": len(samples), "rate": round(float(labels.mean()), 4), "renderings": table}
        print(name, json.dumps(rows["sets"][name]), flush=True)
    Path(args.output).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    print("| set | answers | rendering | part | AUROC | FPR | TPR | median change | flipped |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, row in rows["sets"].items():
        for how, t in row["renderings"].items():
            print(f"| {name} | {row['n']} | {how} | {', '.join(t['task'])} | {t['auroc']:.3f} | {t['fpr']:.2f} | "
                  f"{t['tpr']:.2f} | {t['median_change_from_plain']:.3f} | {t['flipped_from_plain']:.2f} |")


if __name__ == "__main__":
    main()
