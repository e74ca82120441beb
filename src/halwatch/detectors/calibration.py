"""Turning raw detector scores into probabilities, and choosing the decision threshold, on probe data only."""

from __future__ import annotations

import logging

import numpy as np

from halwatch.errors import InputError

CALIBRATIONS = ("platt", "isotonic")


class Calibrator:
    """Platt scaling (a logistic regression on the standardised raw score) or isotonic regression."""

    def __init__(self, method: str = "platt"):
        if method not in CALIBRATIONS:
            raise ValueError(f"unknown calibration {method!r}: choose one of {', '.join(CALIBRATIONS)}")
        self.method = method
        self.params: dict = {}

    def fit(self, raw, labels) -> "Calibrator":
        raw = np.asarray(raw, dtype=float)
        labels = np.asarray(labels, dtype=int)
        if len(np.unique(labels)) < 2:
            raise InputError("the probe data needs both hallucinated (1) and grounded (0) samples to calibrate")
        if self.method == "platt":
            from sklearn.linear_model import LogisticRegression

            mean, std = float(raw.mean()), float(raw.std()) or 1.0
            lr = LogisticRegression(C=1e4, max_iter=1000).fit(((raw - mean) / std)[:, None], labels)
            self.params = {"mean": mean, "std": std, "coef": float(lr.coef_[0, 0]),
                           "intercept": float(lr.intercept_[0])}
            if self.params["coef"] < 0:
                logging.getLogger("halwatch").warning(
                    "the raw score is anti-correlated with the labels on the probe data: the fitted calibration "
                    "reverses it (Platt slope %.3f)", self.params["coef"])
        else:
            from sklearn.isotonic import IsotonicRegression

            iso = IsotonicRegression(out_of_bounds="clip", y_min=0.0, y_max=1.0).fit(raw, labels)
            self.params = {"x": iso.X_thresholds_.tolist(), "y": iso.y_thresholds_.tolist()}
        return self

    def transform(self, raw) -> np.ndarray:
        raw = np.asarray(raw, dtype=float)
        if not self.params:
            raise RuntimeError("calibrator is not fitted")
        if self.method == "platt":
            p = self.params
            z = p["coef"] * (raw - p["mean"]) / p["std"] + p["intercept"]
            return 1.0 / (1.0 + np.exp(-z))
        return np.interp(raw, self.params["x"], self.params["y"])

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


def fit_logistic(x, labels, C: float = 1.0) -> dict:
    """A logistic regression (max_iter 1000) on standardised features, as a JSON-ready dict."""
    from sklearn.linear_model import LogisticRegression

    x = np.asarray(x, dtype=float)
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-8
    lr = LogisticRegression(C=C, max_iter=1000).fit((x - mean) / std, labels)
    return {"mean": mean.tolist(), "std": std.tolist(), "coef": lr.coef_[0].tolist(),
            "intercept": float(lr.intercept_[0])}


def logistic_logodds(model: dict, x) -> np.ndarray:
    """Log-odds of :func:`fit_logistic`'s model on new features."""
    z = (np.asarray(x, dtype=float) - np.array(model["mean"])) / np.array(model["std"])
    return z @ np.array(model["coef"]) + model["intercept"]
