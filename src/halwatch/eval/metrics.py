"""Metrics reported for every run (DESIGN.md conventions): AUROC, AUC-PR, F1 at the fitted threshold, accuracy,
precision, recall, and the trivial "always hallucinated" F1 beside them."""

from __future__ import annotations

import numpy as np

# scikit-learn is imported where a metric is computed: it takes 1.4 s to import, and every command builds its
# parser from this package (halwatch.eval.protocols.PROTOCOLS), `halwatch score` included


def trivial_f1(labels) -> float:
    """F1 of predicting "hallucinated" for every response: ``2p / (1 + p)`` with ``p`` the positive rate."""
    p = float(np.mean(labels))
    return 2 * p / (1 + p) if p > 0 else 0.0


def expected_calibration_error(labels, probs, bins: int = 10) -> float:
    """Expected calibration error: over ``bins`` equal-width bins of the probability, the share-weighted absolute
    gap between the mean probability and the observed rate of hallucinated answers (Naeini et al., 2015)."""
    labels = np.asarray(labels, dtype=float)
    probs = np.asarray(probs, dtype=float)
    which = np.minimum((probs * bins).astype(int), bins - 1)
    total = 0.0
    for b in np.unique(which):
        inside = which == b
        total += inside.mean() * abs(probs[inside].mean() - labels[inside].mean())
    return float(total)


def evaluate(labels, probs, threshold, ranking=None) -> dict:
    """Every metric of one test set. AUROC and AUC-PR rank the answers by ``ranking`` (the detector's raw score,
    oriented as its calibration; default: the probabilities), never by probabilities that clipping or saturation
    can tie; the verdicts (F1, accuracy, precision, recall, and the operating point: false- and true-positive
    rates) compare the probabilities with the threshold (one, or one per answer); ``ece`` is the expected
    calibration error, beside the mean probability and the observed ``rate`` of hallucinated answers."""
    from sklearn.metrics import (
        accuracy_score,
        average_precision_score,
        f1_score,
        precision_score,
        recall_score,
        roc_auc_score,
    )

    labels = np.asarray(labels, dtype=int)
    probs = np.asarray(probs, dtype=float)
    ranking = probs if ranking is None else np.asarray(ranking, dtype=float)
    pred = probs >= threshold
    both = len(np.unique(labels)) == 2
    return {
        "auroc": float(roc_auc_score(labels, ranking)) if both else float("nan"),
        "auc_pr": float(average_precision_score(labels, ranking)) if both else float("nan"),
        "fpr": float(pred[labels == 0].mean()) if (labels == 0).any() else float("nan"),
        "tpr": float(pred[labels == 1].mean()) if (labels == 1).any() else float("nan"),
        "ece": expected_calibration_error(labels, probs),
        "mean_prob": float(probs.mean()),
        "rate": float(labels.mean()),
        "f1": float(f1_score(labels, pred, zero_division=0)),
        "accuracy": float(accuracy_score(labels, pred)),
        "precision": float(precision_score(labels, pred, zero_division=0)),
        "recall": float(recall_score(labels, pred, zero_division=0)),
        "trivial_f1": trivial_f1(labels),
        "n_test": int(len(labels)),
        "n_pos": int(labels.sum()),
    }


def span_scores(predicted, gold) -> dict:
    """Character-level precision, recall and F1 of predicted spans against gold spans, pooled over responses
    (micro average); each argument is a list (one per response) of ``{"start", "end"}`` spans."""
    tp = n_pred = n_gold = 0
    for pred_spans, gold_spans in zip(predicted, gold):
        p = {c for s in pred_spans for c in range(s["start"], s["end"])}
        g = {c for s in gold_spans for c in range(s["start"], s["end"])}
        tp, n_pred, n_gold = tp + len(p & g), n_pred + len(p), n_gold + len(g)
    precision = tp / n_pred if n_pred else 0.0
    recall = tp / n_gold if n_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if tp else 0.0
    return {"span_precision": precision, "span_recall": recall, "span_f1": f1}


def _aurocs(labels: np.ndarray, scores: np.ndarray, index: np.ndarray) -> np.ndarray:
    """AUROC of ``scores`` on each resample (row of ``index``), by the Mann-Whitney rank sum (ties get mid-ranks);
    NaN for a resample with one class only."""
    from scipy.stats import rankdata

    y = labels[index]
    ranks = rankdata(scores[index], axis=1)
    n_pos = y.sum(1)
    n_neg = y.shape[1] - n_pos
    with np.errstate(invalid="ignore", divide="ignore"):
        return ((ranks * y).sum(1) - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def paired_bootstrap(labels, rankings: dict, reference: str, n_boot: int = 2000, seed: int = 0) -> dict:
    """AUROC of each detector on one test set with a 95 % percentile bootstrap interval, and the paired difference
    to ``reference`` (the same resampled answers for both) with its interval and a two-sided bootstrap p-value
    (twice the smaller tail of the differences around 0). ``rankings``: detector -> ranking scores of the answers."""
    from sklearn.metrics import roc_auc_score

    labels = np.asarray(labels, dtype=int)
    index = np.random.default_rng(seed).integers(0, len(labels), size=(n_boot, len(labels)))
    boot = {name: _aurocs(labels, np.asarray(s, dtype=float), index) for name, s in rankings.items()}
    valid = np.all([np.isfinite(b) for b in boot.values()], axis=0)
    out = {}
    for name, values in boot.items():
        diff = values[valid] - boot[reference][valid]
        out[name] = {
            "auroc": float(roc_auc_score(labels, rankings[name])),
            "ci": [float(q) for q in np.quantile(values[valid], [0.025, 0.975])],
            "diff": float(roc_auc_score(labels, rankings[name]) - roc_auc_score(labels, rankings[reference])),
            "diff_ci": [float(q) for q in np.quantile(diff, [0.025, 0.975])],
            "p": 1.0 if name == reference else float(min(1.0, 2 * min((diff <= 0).mean(), (diff >= 0).mean()))),
        }
    return out
