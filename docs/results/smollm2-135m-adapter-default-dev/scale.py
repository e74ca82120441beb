"""Do the fold adapters and the adapter that ships score on one scale? The stack is fitted on the fold adapters'
log-odds of RAGTruth's training answers (each from the fold that did not see its source) and scores every other
answer with the adapter trained on all of them (more data, more steps). Where the shipped adapter's log-odds of
unseen answers run higher or lower than the folds' of theirs, the stack's threshold and calibration move with them.

Both are held out: the folds' log-odds of the training answers and the final adapter's of the dev answers, never
trained on. Per label: the mean and quartiles of each answer's highest token log-odds, and its AUROC. Run after step
3 of commands.txt, whose passes (and the stack fit's fold passes) are in the signal cache; with its precision:

    HALWATCH_HOME=... python scale.py WORK/adapter-ragtruth-train.json
"""

import sys

import numpy as np
from sklearn.metrics import roc_auc_score

from halwatch.data.splits import split_of
from halwatch.detectors.adapter import load_adapter
from halwatch.eval.datasets import load_dataset
from halwatch.models.signal_types import SignalRequest
from halwatch.scorer import Scorer


def highest(signals) -> np.ndarray:
    return np.array([float(np.max(s.adapter)) for s in signals])


def describe(name: str, values: np.ndarray, labels: np.ndarray) -> str:
    rows = [f"{name}: {len(values)} answers, AUROC {roc_auc_score(labels, values):.3f}"]
    for label in (0, 1):
        v = values[labels == label]
        q = np.quantile(v, [0.25, 0.5, 0.75])
        rows.append(f"  label {label} ({len(v)}): mean {v.mean():+.2f}, quartiles {q[0]:+.2f} / {q[1]:+.2f} / "
                    f"{q[2]:+.2f}")
    return "\n".join(rows)


def main(artifact: str) -> None:
    scorer = Scorer(dtype="bfloat16")
    adapter = load_adapter(artifact, scorer)
    samples = load_dataset("ragtruth:all")[0]
    train = [s for s in samples if split_of(s) == "train"]
    dev = [s for s in samples if split_of(s) == "dev"]
    views = [scorer.encode(s) for s in train]
    held = np.full(len(train), np.nan)
    for k, idx in sorted(adapter.fold_plan(views).items()):
        got = scorer.signals([train[i] for i in idx], SignalRequest(adapter=adapter.fold_request(k)),
                             views=[views[i] for i in idx])
        held[idx] = highest(got)
    kept = ~np.isnan(held)
    labels = np.array([s.label for s in train])[kept]
    print(describe("folds' adapters, RAGTruth training answers (held out by source)", held[kept], labels))
    final = highest(scorer.signals(dev, SignalRequest(adapter=adapter.adapter_request())))
    print(describe("the shipped adapter, RAGTruth dev answers (never trained on)", final,
                   np.array([s.label for s in dev])))


if __name__ == "__main__":
    main(sys.argv[1])
