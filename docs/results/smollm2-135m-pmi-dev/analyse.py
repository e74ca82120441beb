"""What conditional PMI adds, on the dev split (issue 36 names LM-Polygraph's conditional PMI as the best
estimator on news summaries). Reads capture.py's files: per response token, log p with the whole prompt (``ctx``),
with the prompt less its context (``noctx``: instruction and question kept) and after the answer header alone
(``hdr``). PMI of a token = log p(token | prompt) - log p(token | prompt without context); a made-up token is one the
context did not make likelier, so a low PMI points to a hallucination (van der Poel, Cotterell and Meister, EMNLP
2022, sec. 3: CPMI; here as a feature, not as a decoding rule).

Prints per dataset the AUROC of each statistic alone (oriented: low log-probability, low PMI = hallucinated), of
all PMI statistics in one logistic regression (source-grouped cross-fitting on dev), the token AUROC against the
human spans, and what the mean PMI adds to the routed default's committed dev scores (train-only fit): the mean
over 20 fold seeds of the cross-fitted AUROC gain, and a bootstrap over sources of the gain (one seed).
Usage: analyse.py WORK DATASET [DATASET ...]  (WORK: where capture.py wrote DATASET.npz)"""

import json
import sys
from pathlib import Path

import numpy as np
from scipy.special import logit
from sklearn.metrics import roc_auc_score

from halwatch.detectors import linear
from halwatch.detectors.base import cross_fit

ROUTED = Path(__file__).resolve().parents[1] / "smollm2-135m-routed-dev" / "predictions.jsonl"
STATS = ("mean", "min", "q10", "share < -1")


def stats(values) -> list[float]:
    a = np.asarray(values, dtype=float)
    return [a.mean(), a.min(), np.quantile(a, 0.1), (a < -1).mean()]


def held_auroc(x, y, src, seed) -> tuple[float, np.ndarray]:
    folds = linear.folds_of(y, 5, src, seed)
    held, _ = cross_fit(folds, lambda tr: linear.fit(x[tr], y[tr], groups=src[tr]),
                        lambda m, h: linear.logodds(m, x[h]), len(y))
    held = np.array(held, dtype=float)
    return roc_auc_score(y, held), held


def main(work, names, seeds=20, draws=1000):
    routed = {r["dataset"]: r for r in map(json.loads, ROUTED.read_text().splitlines()) if r["detector"] == "routed"}
    print("| dev set | answers | length | mean log p | PMI, question kept: " + " / ".join(STATS)
          + " | header only: " + " / ".join(STATS) + " | all PMI statistics | token AUROC: surprisal / -PMI "
          "(question) / -PMI (header) | routed | routed + mean PMI (question kept): gain (sd over seeds) "
          "| source bootstrap 95 % |")
    print("| --- " * 11 + "|")
    for name in names:
        z = np.load(Path(work) / f"{name}.npz", allow_pickle=True)
        y, src = np.array(z["labels"], dtype=int), np.array(z["src"])
        ctx, noctx, hdr = z["ctx"], z["noctx"], z["hdr"]
        pmi_q = [c - n for c, n in zip(ctx, noctx)]
        pmi_h = [c - h for c, h in zip(ctx, hdr)]
        fq, fh = np.array([stats(p) for p in pmi_q]), np.array([stats(p) for p in pmi_h])
        cells = [name, str(len(y)), f"{roc_auc_score(y, [len(c) for c in ctx]):.3f}",
                 f"{roc_auc_score(y, [-np.mean(c) for c in ctx]):.3f}",
                 " / ".join(f"{roc_auc_score(y, -fq[:, i]):.3f}" for i in range(3))
                 + f" / {roc_auc_score(y, fq[:, 3]):.3f}",
                 " / ".join(f"{roc_auc_score(y, -fh[:, i]):.3f}" for i in range(3))
                 + f" / {roc_auc_score(y, fh[:, 3]):.3f}",
                 f"{np.mean([held_auroc(np.hstack([fq, fh]), y, src, s)[0] for s in range(5)]):.3f}"]
        tokens = z["tok"]
        if any(t.sum() for t in tokens):
            lab = np.concatenate(tokens)
            cells.append(" / ".join(f"{roc_auc_score(lab, np.concatenate(a)):.3f}"
                                    for a in ([-c for c in ctx], [-p for p in pmi_q], [-p for p in pmi_h])))
        else:
            cells.append("-")
        if name in routed:
            row = routed[name]
            assert row["labels"] == list(y), f"{name}: the routed predictions are of other answers"
            base = logit(np.clip(np.array(row["probs"]), 1e-6, 1 - 1e-6))[:, None]
            both = np.hstack([base, fq[:, :1]])
            runs = [(held_auroc(base, y, src, s), held_auroc(both, y, src, s)) for s in range(seeds)]
            gains = [with_pmi[0] - alone[0] for alone, with_pmi in runs]
            (_, b0), (_, b1) = runs[0]  # the held-out scores of seed 0, for the bootstrap
            rng, boot, sources = np.random.default_rng(0), [], np.unique(src)
            for _ in range(draws):
                pick = np.concatenate([np.flatnonzero(src == s) for s in rng.choice(sources, len(sources))])
                if len(set(y[pick])) == 2:
                    boot.append(roc_auc_score(y[pick], b1[pick]) - roc_auc_score(y[pick], b0[pick]))
            cells += [f"{roc_auc_score(y, base[:, 0]):.3f}", f"{np.mean(gains):+.4f} ({np.std(gains):.4f})",
                      f"{np.quantile(boot, 0.025):+.4f} .. {np.quantile(boot, 0.975):+.4f}"]
        else:
            cells += ["-", "-", "-"]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
