"""What the adapter would add to the routed default's answer score, estimated on RAGTruth's dev answers alone by
source-grouped cross-fitting (halwatch's own folds, logistic regression and out-of-fold path: each fifth of the
sources scored by a stack fitted on the other four): the routed default's log-odds alone, the adapter's pooled token
log-odds (max, top-3 mean, mean) alone, and both. Usage: stack.py WORK TAG (after ``train.py WORK dev TAG``)"""

import sys
from pathlib import Path

import numpy as np
from compare import routed_dev
from scipy.special import logit
from sklearn.metrics import roc_auc_score

from halwatch.data.splits import split_of
from halwatch.detectors import linear
from halwatch.detectors.base import cross_fit
from halwatch.eval.datasets import load_dataset


def main(work, tag, seeds=5):
    routed = routed_dev()["ragtruth:all"]
    labels = np.array(routed["labels"])
    tokens = np.load(Path(work) / f"dev-{tag}-dev-tokens.npy", allow_pickle=True)
    sources = np.array([s.source for s in load_dataset("ragtruth:all")[0] if split_of(s) == "dev"])
    assert len(sources) == len(labels) == len(tokens)
    default = logit(np.clip(np.array(routed["probs"]), 1e-6, 1 - 1e-6))[:, None]
    pooled = np.array([[x.max(), np.sort(x)[-3:].mean(), x.mean()] for x in tokens])
    print("| inputs of the stack | AUROC (mean over seeds of the folds) |")
    print("| --- | --- |")
    for name, x in (("routed default", default), ("adapter, pooled", pooled),
                    ("both", np.hstack([default, pooled]))):
        found = []
        for seed in range(seeds):
            folds = linear.folds_of(labels, 5, sources, seed)
            out, _ = cross_fit(folds, lambda train: linear.fit(x[train], labels[train], groups=sources[train]),
                               lambda model, held: linear.logodds(model, x[held]), len(labels))
            found.append(roc_auc_score(labels, np.array(out, dtype=float)))
        print(f"| {name} | {np.mean(found):.4f} (sd {np.std(found):.4f}) |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
