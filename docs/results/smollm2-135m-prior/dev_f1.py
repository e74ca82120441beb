"""Dev-split check of a threshold that `halwatch calibrate --prior estimate` could also move (measured, not built):
on the committed dev predictions of the train-only routed fit (../smollm2-135m-routed-dev), 50 resamples drawn at
each share of hallucinated answers, the F1 of the part's fitted threshold against a plug-in threshold (the one that
maximises the expected F1 of the unlabelled answers under their restated probabilities) and the best F1 any
threshold reaches on the resample.

    .venv/bin/python docs/results/smollm2-135m-prior/dev_f1.py
"""

import json
from pathlib import Path

import numpy as np
from scipy.special import expit

from halwatch.detectors.calibration import estimate_prior, logit

# each dev set: (the share its part's probabilities assume, the part's threshold), from dev_check.py and the
# routed dev table in ../log.md
PARTS = {"ragtruth:all": (0.4959, 0.453), "squad-shapes": (0.4959, 0.453), "begin": (0.6168, 0.557),
         "faithdial": (0.6168, 0.557)}


def f1(labels, flagged):
    return 2 * (flagged & (labels == 1)).sum() / (flagged.sum() + labels.sum())


def plug_in(probs):
    """The threshold with the highest expected F1 when each answer is hallucinated with its probability."""
    ordered = np.sort(probs)[::-1]
    expected = 2 * np.cumsum(ordered) / (np.arange(1, len(ordered) + 1) + ordered.sum())
    return ordered[int(np.argmax(expected))]


def main():
    rows = [json.loads(line) for line in open(Path(__file__).parent.parent / "smollm2-135m-routed-dev" /
                                              "predictions.jsonl")]
    rng = np.random.default_rng(0)
    print("| dev set | share | F1 at the fitted threshold | plug-in | best on the resample |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        if row["detector"] != "routed" or row["dataset"] not in PARTS:
            continue
        assumed, threshold = PARTS[row["dataset"]]
        y, p = np.array(row["labels"]), np.array(row["probs"])
        pos, neg = np.flatnonzero(y == 1), np.flatnonzero(y == 0)
        for share in (0.1, 0.26, 0.5):
            n = int(min(300, len(pos) / share, len(neg) / (1 - share)))
            k = int(round(n * share))
            found = []
            for _ in range(50):
                idx = np.r_[rng.choice(pos, k, replace=False), rng.choice(neg, n - k, replace=False)]
                yy, pp = y[idx], p[idx]
                restated = expit(logit(pp) + logit(estimate_prior(pp, assumed)) - logit(assumed))
                found.append((f1(yy, pp >= threshold), f1(yy, restated >= plug_in(restated)),
                              max(f1(yy, pp >= t) for t in np.unique(pp))))
            m = np.mean(found, axis=0)
            print(f"| {row['dataset']} | {share:.2f} | {m[0]:.3f} | {m[1]:.3f} | {m[2]:.3f} |")


if __name__ == "__main__":
    main()
