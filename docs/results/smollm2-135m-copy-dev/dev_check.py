"""Dev-split check of the copy attention for the token model (issue 33): the `fused` detector fitted on RAGTruth's
training answers (train split, source-disjoint from dev) with and without `copy=true`, read on its dev answers:
character span F1, answer AUROC, and the operating point at the fitted threshold (`decision=fpr=0.2`), beside
response length's AUROC. Both variants read the same `copy=true` pass (the other only ignores the copy block).

    .venv/bin/python docs/results/smollm2-135m-copy-dev/dev_check.py [--cached-only] [DATASET]

`--cached-only` uses only the answers whose signals are already in the cache (a partial check while the cache is
being filled, e.g. by `halwatch fit ... --set copy=true`); it prints how many answers each side has.
"""

import argparse
import json
import time

import numpy as np
from sklearn.metrics import roc_auc_score

from halwatch.data.splits import split_of
from halwatch.detectors import create_detector
from halwatch.detectors.fused import signal_request
from halwatch.eval.datasets import load_dataset
from halwatch.eval.metrics import evaluate, span_scores
from halwatch.scorer import Scorer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset", nargs="?", default="ragtruth:all")
    parser.add_argument("--cached-only", action="store_true")
    args = parser.parse_args()
    scorer = Scorer(batch_size=None)
    request = signal_request(scorer.model, copy=True)
    samples = [s for s in load_dataset(args.dataset)[0] if split_of(s) in ("train", "dev")]
    views = [scorer.encode(s) for s in samples]
    if args.cached_only:
        keep = [i for i, hit in enumerate(scorer.cached(views, request)) if hit]
        samples, views = [samples[i] for i in keep], [views[i] for i in keep]
    signals = scorer.signals(samples, request, views=views, progress=True)
    train = [i for i, s in enumerate(samples) if split_of(s) == "train"]
    dev = [i for i, s in enumerate(samples) if split_of(s) == "dev"]
    labels = np.array([s.label for s in samples])
    y = labels[dev]
    lengths = np.array([signals[i].n_response for i in dev])
    print(f"{args.dataset}: {len(train)} training answers ({labels[train].mean():.2f} hallucinated), {len(dev)} dev "
          f"answers ({y.mean():.2f}); length AUROC on dev {roc_auc_score(y, lengths):.3f}")
    for copy in (False, True):
        start = time.time()
        detector = create_detector("fused", scorer=scorer, decision="fpr=0.2", copy=copy)
        detector.fit_signals([signals[i] for i in train], labels[train], [views[i] for i in train])
        verdicts = detector.verdicts([views[i] for i in dev], [signals[i] for i in dev])
        p = np.array([v["score"] for v in verdicts])
        answers = evaluate(y, p, detector.threshold)
        row = {"copy": copy, **{k: answers[k] for k in ("auroc", "f1", "fpr", "tpr")},
               **span_scores([v["spans"] for v in verdicts], [samples[i].spans for i in dev]),
               "grounded_without_span": np.mean([not v["spans"] for v, label in zip(verdicts, y) if label == 0]),
               "seconds": time.time() - start}
        print(json.dumps({k: round(float(x), 4) if not isinstance(x, bool) else x for k, x in row.items()}),
              flush=True)


if __name__ == "__main__":
    main()
