"""Dev comparison for the summary part: the recipe fitted with more SummEdits answers per document (``summedits@12``,
``summedits@all``) against the shipped recipe (6 per document, docs/results/smollm2-135m-summary-dev), on the same
dev answers: for SummEdits the 165 dev answers of the shipped cap (a subset of those read with a wider cap) and all
the wider cap's dev answers.

    python docs/results/smollm2-135m-summary-more-dev/compare.py NEW_FOLDER

Prints each dev set's AUROC for both recipes beside length's (its better orientation), and the new run's FPR, TPR, F1
and ECE at its own threshold (from its results.json)."""

import json
import sys
from pathlib import Path

import numpy as np
from sklearn.metrics import roc_auc_score

from halwatch.eval.datasets import load_dataset

HERE = Path(__file__).parent
OLD = HERE.parent / "smollm2-135m-summary-dev" / "predictions.jsonl"


def rows(path):
    """The first row of each (dataset, detector): the model fitted with the set included (held-out rows follow)."""
    out = {}
    for r in map(json.loads, Path(path).read_text().splitlines()):
        out.setdefault((r["dataset"].split("@")[0], r["detector"]), r)
    return out


def auroc(row):
    return f"{roc_auc_score(row['labels'], row['probs']):.3f} (n {len(row['labels'])})"


def length_auroc(labels, lengths):
    a = roc_auc_score(labels, lengths)
    return round(max(a, 1 - a), 3)


def main(folder):
    new, old = rows(Path(folder) / "predictions.jsonl"), rows(OLD)
    results = json.loads((Path(folder) / "results.json").read_text())
    wide = next(r["dataset"] for r in results if r["dataset"].startswith("summedits@"))
    every = [s for s in load_dataset(wide)[0] if s.meta["split"] == "dev"]
    capped = {s.id for s in load_dataset("summedits")[0] if s.meta["split"] == "dev"}
    keep = np.array([s.id in capped for s in every])
    det = "routed:fallback=summary"
    for name in ("diasumfact", "summedits", "xsum-hallucination", "bump"):
        n, o = new[(name, det)], old[(name, det)]
        nl, ol = new[(name, "length")], old[(name, "length")]
        if name == "summedits":
            assert len(n["labels"]) == len(every) and list(np.asarray(n["labels"])[keep]) == o["labels"]
            sub = {k: list(np.asarray(n[k])[keep]) for k in ("labels", "probs")}
            print(f"{wide}, all its dev answers: new {auroc(n)}, length {length_auroc(nl['labels'], nl['raw'])}")
            n = sub
        else:
            assert n["labels"] == o["labels"]
        print(f"{name}: new {auroc(n)}, shipped recipe {auroc(o)}, length {length_auroc(ol['labels'], ol['raw'])}")
    for r in results:
        if r["detector"] == det and r["settings"].get("training") != "held-out":
            print(f"new at its threshold, {r['dataset']} ({r['n_test']}): FPR {r['fpr']:.2f} TPR {r['tpr']:.2f} "
                  f"F1 {r['f1']:.3f} ECE {r['ece']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
