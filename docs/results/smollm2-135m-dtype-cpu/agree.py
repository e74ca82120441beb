"""The shipped default (fitted on float32 signals until 2026-12-06, on bfloat16 ones since: its artifact's "dtype")
scoring the same answers on the CPU in float32 and in bfloat16:
how far the probabilities move, how many verdicts flip at the part's shipped threshold, the AUROC in each, and the
answers/s of each (whole scoring path, one process, no signal cache, the model loaded before the clock). A seeded
sample of N dev answers of DATASET; these dev answers were part of the default's fit, so the AUROCs compare the two
precisions, not the detector. Usage: agree.py DATASET N"""

import sys
import time

import numpy as np
from sklearn.metrics import roc_auc_score

from halwatch.data.splits import split_of
from halwatch.detectors import load_detector
from halwatch.eval.datasets import load_dataset
from halwatch.sample import task_of
from halwatch.scorer import Scorer


def main(name, n):
    samples = [s for s in load_dataset(name)[0] if split_of(s) == "dev"]
    samples = [samples[i] for i in sorted(np.random.default_rng(0).permutation(len(samples))[:n])]
    labels = np.array([s.label for s in samples])
    probs, rate = {}, {}
    for dtype in ("float32", "bfloat16"):
        scorer = Scorer(device="cpu", dtype=dtype, cache=False)
        scorer.model  # loaded before the clock starts
        detector = load_detector("default", scorer=scorer)
        start = time.time()
        probs[dtype] = detector.score(samples)
        rate[dtype] = len(samples) / (time.time() - start)
    a, b = probs["float32"], probs["bfloat16"]
    cut = np.array([detector.parts[detector.route(task_of(s))].threshold for s in samples])  # each answer's part
    moved = np.abs(a - b)
    flips = ((a >= cut) != (b >= cut)).mean()
    print(f"| {name} | {len(samples)} | {np.median(moved):.4f} | {np.quantile(moved, 0.95):.4f} | {moved.max():.4f} "
          f"| {flips:.3f} | {roc_auc_score(labels, a):.4f} / {roc_auc_score(labels, b):.4f} "
          f"| {rate['float32']:.2f} / {rate['bfloat16']:.2f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
