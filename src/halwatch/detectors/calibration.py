"""Turning raw detector scores into probabilities, and choosing the decision threshold, on probe data only."""

from __future__ import annotations

import logging

import numpy as np

from halwatch.errors import InputError

CALIBRATIONS = ("platt", "isotonic")


class Calibrator:
    """Platt scaling (a logistic regression on the standardised raw score) or isotonic regression.

    Platt scaling is fitted to Platt's smoothed targets (Platt 1999, section 2.2): ``(N+ + 1) / (N+ + 2)`` for a
    hallucinated probe answer and ``1 / (N- + 2)`` for a grounded one, not to 0 and 1, so that a probe whose scores
    separate the classes does not give an infinite slope; and every probability is kept between those two targets,
    the most a probe of that size can vouch for, so no answer scores exactly 0 or 1. Probabilities only *report*:
    answers are ranked by :meth:`ranking`, the raw score turned the way the calibration runs, which has no ties that
    the raw score does not have.
    """

    def __init__(self, method: str = "platt"):
        if method not in CALIBRATIONS:
            raise ValueError(f"unknown calibration {method!r}: choose one of {', '.join(CALIBRATIONS)}")
        self.method = method
        self.params: dict = {}

    def fit(self, raw, labels, oriented: bool = False) -> "Calibrator":
        raw = np.asarray(raw, dtype=float)
        labels = np.asarray(labels, dtype=int)
        if len(np.unique(labels)) < 2:
            raise InputError("the probe data needs both hallucinated (1) and grounded (0) samples to calibrate")
        n_pos, n_neg = int(labels.sum()), int((1 - labels).sum())
        bounds = {"p_min": 1.0 / (n_neg + 2), "p_max": (n_pos + 1.0) / (n_pos + 2)}
        if self.method == "platt":
            from sklearn.linear_model import LogisticRegression

            mean, std = float(raw.mean()), float(raw.std()) or 1.0
            z = ((raw - mean) / std)[:, None]
            target = np.where(labels == 1, bounds["p_max"], bounds["p_min"])
            # soft targets as two weighted copies of every answer: label 1 with weight t, label 0 with 1 - t
            lr = LogisticRegression(C=1e4, max_iter=1000).fit(
                np.vstack([z, z]), np.r_[np.ones(len(z)), np.zeros(len(z))], sample_weight=np.r_[target, 1 - target])
            self.params = {"mean": mean, "std": std, "coef": float(lr.coef_[0, 0]),
                           "intercept": float(lr.intercept_[0]), **bounds}
            if self.params["coef"] < 0 and oriented:
                logging.getLogger("halwatch").warning(
                    "the detector's held-out scores on the probe data run against the labels (Platt slope %.3f): it "
                    "is not turned round; its probabilities are the probe's base rate", self.params["coef"])
                base = float(target.mean())
                self.params |= {"coef": 0.0, "intercept": float(np.log(base / (1 - base)))}
            elif self.params["coef"] < 0:
                logging.getLogger("halwatch").warning(
                    "the raw score is anti-correlated with the labels on the probe data: the fitted calibration "
                    "reverses it (Platt slope %.3f)", self.params["coef"])
        else:
            from sklearn.isotonic import IsotonicRegression

            iso = IsotonicRegression(out_of_bounds="clip", y_min=bounds["p_min"], y_max=bounds["p_max"])
            iso.fit(raw, labels)
            self.params = {"x": iso.X_thresholds_.tolist(), "y": iso.y_thresholds_.tolist(), **bounds}
        return self

    def transform(self, raw) -> np.ndarray:
        """Probabilities of hallucination, within the probe's bounds."""
        raw = np.asarray(raw, dtype=float)
        if not self.params:
            raise RuntimeError("calibrator is not fitted")
        p = self.params
        if self.method == "platt":
            from scipy.special import expit

            probs = expit(p["coef"] * (raw - p["mean"]) / p["std"] + p["intercept"])
        else:
            probs = np.interp(raw, p["x"], p["y"])
        return np.clip(probs, p.get("p_min", 0.0), p.get("p_max", 1.0))

    def ranking(self, raw) -> np.ndarray:
        """The score answers are ranked by (AUROC, AUC-PR): the raw score, reversed where the Platt slope is
        negative. The calibration is monotone in it, so it orders answers as the probabilities do, without the
        ties that clipping or saturation put into probabilities."""
        raw = np.asarray(raw, dtype=float)
        if self.method == "platt" and self.params.get("coef", 1.0) < 0:
            return -raw
        return raw

    def to_dict(self) -> dict:
        return {"method": self.method, **self.params}

    @classmethod
    def from_dict(cls, d: dict) -> "Calibrator":
        c = cls(d["method"])
        c.params = {k: v for k, v in d.items() if k != "method"}
        return c


def best_f1_threshold(scores, labels) -> float:
    """The threshold ``t`` (predict 1 when ``score >= t``) with the highest F1 on the given data.

    Ties go to the highest such threshold; the value returned lies midway to the next lower score so that it
    does not sit exactly on a probe score.
    """
    scores = np.asarray(scores, dtype=float)
    labels = np.asarray(labels, dtype=int)
    order = np.argsort(-scores, kind="stable")
    s, y = scores[order], labels[order]
    tp = np.cumsum(y)
    fp = np.cumsum(1 - y)
    last = np.r_[s[1:] != s[:-1], True]  # only cut between distinct scores
    f1 = np.where(last, 2 * tp / (tp + fp + y.sum()), -1.0)
    k = int(np.argmax(f1))
    return float((s[k] + s[k + 1]) / 2) if k + 1 < len(s) else float(s[k])


#: The regularisation strengths that ``C="cv"`` chooses from.
C_GRID = tuple(float(c) for c in np.logspace(-4, 2, 7))


def fit_logistic(x, labels, C: float | str = 1.0, groups=None, folds: int = 5, seed: int = 0) -> dict:
    """A logistic regression (max_iter 1000) on standardised features, as a JSON-ready dict.

    ``C="cv"`` chooses the inverse regularisation strength from :data:`C_GRID` by cross-validated log-loss on the
    data itself (stratified ``folds``-fold; with ``groups``, e.g. the answer of each window, a group never spans two
    folds); the chosen value is kept as ``C``."""
    from sklearn.linear_model import LogisticRegression, LogisticRegressionCV
    from sklearn.model_selection import StratifiedGroupKFold, StratifiedKFold

    x = np.asarray(x, dtype=float)
    labels = np.asarray(labels, dtype=int)
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-8
    z = (x - mean) / std
    if C == "cv":
        k = max(2, min(folds, int(np.bincount(labels).min())))
        if groups is None:
            splits = list(StratifiedKFold(k, shuffle=True, random_state=seed).split(z, labels))
        else:
            splits = list(StratifiedGroupKFold(k, shuffle=True, random_state=seed).split(z, labels, groups))
        lr = LogisticRegressionCV(Cs=list(C_GRID), cv=splits, scoring="neg_log_loss", max_iter=1000, l1_ratios=(0,),
                                  use_legacy_attributes=False).fit(z, labels)
        C = float(np.ravel(lr.C_)[0])
    else:
        lr = LogisticRegression(C=float(C), max_iter=1000).fit(z, labels)
    return {"mean": mean.tolist(), "std": std.tolist(), "coef": lr.coef_[0].tolist(),
            "intercept": float(lr.intercept_[0]), "C": float(C)}


def logistic_logodds(model: dict, x) -> np.ndarray:
    """Log-odds of :func:`fit_logistic`'s model on new features."""
    z = (np.asarray(x, dtype=float) - np.array(model["mean"])) / np.array(model["std"])
    return z @ np.array(model["coef"]) + model["intercept"]
