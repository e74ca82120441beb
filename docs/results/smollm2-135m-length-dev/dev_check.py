"""Dev check (issue 36): the routed default's `qa` part fitted on every QA answer (as shipped) against two parts
split by response length, answers under CUT tokens and the rest, each `fused` with `decision=fpr=0.2`, fitted on
the train parts of the four QA sets and read on their dev parts, per set and per length side.

    .venv/bin/python docs/results/smollm2-135m-length-dev/dev_check.py 0    # the training answers' lengths only
    .venv/bin/python docs/results/smollm2-135m-length-dev/dev_check.py 48   # both variants (about 80 minutes)

CUT was read off the training lengths (RAGTruth's 5th percentile 51 tokens, the SQuAD-built answers' 95th 63).
"""
import json
import sys
import time

import numpy as np

from halwatch.data.splits import split_of
from halwatch.detectors import create_detector
from halwatch.detectors.fused import signal_request
from halwatch.eval.datasets import load_dataset
from halwatch.eval.metrics import evaluate, span_scores
from halwatch.scorer import Scorer

NAMES = "ragtruth:all ragtruth-qa:all squad-shapes squad-shapes-ragtruth".split()
cut = int(sys.argv[1]) if len(sys.argv) > 1 else 0
sc = Scorer(batch_size=None)
req = signal_request(sc.model)
V, G, D = [], [], []
for name in NAMES:
    samples = [s for s in load_dataset(name)[0] if split_of(s) in ("train", "dev")]
    views = [v for v in sc.encode_many(samples, windows=False, keep_errors=True) if not isinstance(v, Exception)]
    views = [v[0] if isinstance(v, list) else v for v in views]
    sigs = sc.signals([v.sample for v in views], req, views=views)
    V += views
    G += sigs
    D += [name] * len(views)
y = np.array([v.sample.label for v in V])
D = np.array(D)
L = np.array([g.n_response for g in G])
tr = np.array([split_of(v.sample) == "train" for v in V])
print("train lengths by set:", {n: np.percentile(L[tr & (D == n)], [5, 25, 50, 75, 95]).tolist() for n in NAMES},
      flush=True)
if cut == 0:
    sys.exit()
def fit(idx):
    t = time.time()
    det = create_detector("fused", scorer=sc, decision="fpr=0.2")
    det.fit_signals([G[i] for i in idx], y[idx], [V[i] for i in idx])
    print("fit", len(idx), f"{time.time()-t:.0f}s", flush=True)
    return det
variants = {"pooled": [np.ones(len(y), bool)], "split": [L < cut, L >= cut]}
for name, parts in variants.items():
    probs, thr, spans = np.zeros(len(y)), np.zeros(len(y)), [None] * len(y)
    for mask in parts:
        det = fit(np.flatnonzero(mask & tr))
        ev = np.flatnonzero(mask & ~tr)
        for i, v in zip(ev, det.verdicts([V[i] for i in ev], [G[i] for i in ev])):
            probs[i], thr[i], spans[i] = v["score"], v["threshold"], v["spans"]
    for n in NAMES + [f"short<{cut}", "long"]:
        m = ~tr & (D == n) if n in NAMES else ~tr & ((L < cut) if n.startswith("short") else (L >= cut))
        m = np.flatnonzero(m)
        e = evaluate(y[m], probs[m], thr[m])
        sp = span_scores([spans[i] for i in m], [V[i].sample.spans for i in m])
        print(json.dumps({"variant": name, "set": n, "n": len(m),
                          **{k: round(e[k], 3) for k in ("auroc", "f1", "fpr", "tpr", "ece")},
                          "span_f1": round(sp["span_f1"], 3) if "span_f1" in sp else None}), flush=True)
