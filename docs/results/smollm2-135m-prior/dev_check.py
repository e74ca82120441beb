"""Dev-split check of `halwatch calibrate --prior estimate`, on the committed dev predictions of the routed
detector fitted on the training split only (../smollm2-135m-routed-dev, clean commit e5e3189): for each dev set,
the share of hallucinated answers estimated from the probabilities alone, and the expected calibration error as
fitted, restated for the estimate and restated for the true share; then on 30 resamples drawn at other shares.
The shares the parts' probabilities assume are their training answers' (train split; counted from the data).

    .venv/bin/python docs/results/smollm2-135m-prior/dev_check.py
"""

import json
from pathlib import Path

import numpy as np
from scipy.special import expit

from halwatch.data.splits import split_of
from halwatch.detectors.calibration import estimate_prior, estimated_share, logit
from halwatch.errors import InputError
from halwatch.eval.datasets import load_dataset
from halwatch.eval.metrics import expected_calibration_error as ece

PARTS = {"qa": ["ragtruth:all", "ragtruth-qa:all", "squad-shapes", "squad-shapes-ragtruth"],
         "dialogue": ["begin", "faithdial"], "summary": ["diasumfact", "summedits", "xsum-hallucination"]}
HERE = Path(__file__).parent


def training_share(names):
    labels = [s.label for name in names for s in load_dataset(name)[0] if split_of(s) == "train"]
    return float(np.mean(labels))


def restated(probs, assumed, prior):
    return expit(logit(probs) + logit(prior) - logit(assumed))


def main():
    assumed = {part: training_share(names) for part, names in PARTS.items()}
    rows = [json.loads(line) for line in open(HERE.parent / "smollm2-135m-routed-dev" / "predictions.jsonl")]
    rng = np.random.default_rng(0)
    print("| dev set | part (assumed) | answers | true share | estimate (90 % interval) | ECE fitted | restated | "
          "true share |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    resampled = []
    for row in rows:
        if row["detector"] != "routed" or row["dataset"] in ("ragtruth-qa:all", "squad-shapes-ragtruth"):
            continue
        part = next(p for p, names in PARTS.items() if row["dataset"] in names)
        a = assumed[part]
        y, p = np.array(row["labels"]), np.array(row["probs"])
        try:
            found = estimated_share(p, a)
            shown = f"{found['estimate']:.3f} ({found['interval'][0]:.3f}-{found['interval'][1]:.3f})"
            after = f"{ece(y, restated(p, a, found['estimate'])):.3f}"
        except InputError:
            shown, after = f"{estimate_prior(p, a):.3f} (refused)", "-"
        print(f"| {row['dataset']} | {part} ({a:.3f}) | {len(y)} | {y.mean():.3f} | {shown} | {ece(y, p):.3f} | "
              f"{after} | {ece(y, restated(p, a, y.mean())):.3f} |")
        pos, neg = np.flatnonzero(y == 1), np.flatnonzero(y == 0)
        for q in (0.1, 0.26, 0.5, 0.8):
            n = int(min(300, len(pos) / q, len(neg) / (1 - q)))
            k = int(round(n * q))
            found = []
            for _ in range(30):
                idx = np.r_[rng.choice(pos, k, replace=False), rng.choice(neg, n - k, replace=False)]
                est = estimate_prior(p[idx], a)
                found.append((est, ece(y[idx], p[idx]), ece(y[idx], restated(p[idx], a, est)),
                              ece(y[idx], restated(p[idx], a, q))))
            f = np.array(found)
            resampled.append(f"| {row['dataset']} | {q:.2f} | {n} | {f[:, 0].mean():.3f} ± {f[:, 0].std():.3f} | "
                             f"{f[:, 1].mean():.3f} | {f[:, 2].mean():.3f} | {f[:, 3].mean():.3f} |")
    print("\nResampled at other shares (30 draws each): mean estimate ± sd; mean ECE fitted, restated for the "
          "estimate, restated for the true share")
    print("| dev set | share | answers | estimate | ECE fitted | restated | true share |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(resampled))


if __name__ == "__main__":
    main()
