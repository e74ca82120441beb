"""Turning raw detector scores into probabilities, and choosing the decision threshold, on probe data only."""

from __future__ import annotations

import logging

import numpy as np

from halwatch.detectors.logistic import logit, sigmoid
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

    def fit(self, raw, labels, oriented: bool = False, prior: float | None = None) -> "Calibrator":
        """Fit on (held-out) raw scores and labels. The probabilities assume the probe's share of hallucinated
        answers (``rate``), or ``prior`` where given: the log-odds then move by ``logit(prior) - logit(rate)``
        (a change of class prior; the order of the answers and so every verdict stay the same). Both are kept."""
        raw = np.asarray(raw, dtype=float)
        labels = np.asarray(labels, dtype=int)
        if len(np.unique(labels)) < 2:
            raise InputError("the probe data needs both hallucinated (1) and grounded (0) samples to calibrate")
        n_pos, n_neg = int(labels.sum()), int((1 - labels).sum())
        bounds = {"p_min": 1.0 / (n_neg + 2), "p_max": (n_pos + 1.0) / (n_pos + 2)}
        if self.method == "platt":
            from halwatch.detectors import linear

            target = np.where(labels == 1, bounds["p_max"], bounds["p_min"])
            model = linear.fit(raw[:, None], target, C=1e4)  # Platt's soft targets, almost no penalty
            self.params = {"mean": float(linear.unpack(model["mean"])[0]), "std": float(linear.unpack(model["std"])[0]),
                           "coef": float(linear.coefficients(model)[0]), "intercept": model["intercept"], **bounds}
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
        rate = float(labels.mean())
        self.params |= {"rate": rate, "prior": rate if prior is None else float(prior),
                        "shift": 0.0 if prior is None else float(logit(prior) - logit(rate))}
        return self

    def transform(self, raw) -> np.ndarray:
        """Probabilities of hallucination, within the probe's bounds."""
        raw = np.asarray(raw, dtype=float)
        if not self.params:
            raise RuntimeError("calibrator is not fitted")
        p = self.params
        shift = p.get("shift", 0.0) + p.get("restated", 0.0)
        if self.method == "platt":
            probs = sigmoid(p["coef"] * (raw - p["mean"]) / p["std"] + p["intercept"] + shift)
        else:
            probs = np.interp(raw, p["x"], p["y"])
            if shift:
                probs = sigmoid(logit(probs) + shift)
        return np.clip(probs, p.get("p_min", 0.0), p.get("p_max", 1.0))

    def restate(self, prior: float) -> float:
        """Let the probabilities assume ``prior`` as the share of hallucinated answers instead of the one they
        assume now (a change of class prior after the fit: the log-odds move by ``logit(prior) - logit(now)``,
        kept apart from the fit's own ``shift`` as ``restated``). Returns that move, by which a probability
        threshold must move too to keep every verdict (:meth:`as_fitted` undoes it)."""
        if not 0 < prior < 1:
            raise InputError(f"the share of hallucinated answers must be in (0, 1), not {prior}")
        move = float(logit(prior) - logit(self.params["prior"]))
        self.params |= {"prior": float(prior), "restated": self.params.get("restated", 0.0) + move}
        return move

    def as_fitted(self, probs):
        """Probabilities (or a threshold) put back on the scale of the fit, before any :meth:`restate`: what the
        span rule, fitted on that scale, is given."""
        move = self.params.get("restated", 0.0)
        if not move:
            return probs
        return sigmoid(logit(probs) - move)

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


def estimate_prior(probs, assumed: float, tol: float = 1e-7, max_iter: int = 2000):
    """The share of hallucinated answers among unlabelled answers, from their probabilities ``probs`` (which
    assume the share ``assumed``), by the EM procedure of Saerens, Latinne and Decaestecker, "Adjusting the
    outputs of a classifier to new a priori probabilities: a simple procedure" (Neural Computation 14, 2002; not
    among the project's papers, so cited by its procedure rather than an equation number): E-step, each answer's
    probability under the current share ``q``,
    ``p_i(q) = sigmoid(logit(p_i) + logit(q) - logit(assumed))``; M-step, ``q = mean_i p_i(q)``; repeated until
    ``q`` moves less than ``tol``. It is the maximum-likelihood share under label shift: the answers differ from
    the training answers only in how many are hallucinated, each class's answers looking as they did. ``probs``
    may be a matrix: one estimate per row (the bootstrap's resamples at once), else one float."""
    logits = logit(np.atleast_2d(np.asarray(probs, dtype=float)))
    base = float(logit(assumed))
    q = np.full(len(logits), float(assumed))
    for _ in range(max_iter):
        new = sigmoid(logits + (logit(q) - base)[:, None]).mean(axis=1)
        new = np.clip(new, 1e-6, 1 - 1e-6)
        done = np.abs(new - q).max() < tol
        q = new
        if done:
            break
    return q if np.ndim(probs) > 1 else float(q[0])


#: The fewest unlabelled answers :meth:`halwatch.detectors.base.Detector.restate_prior` estimates a share from.
MIN_FOR_SHARE = 20


def estimated_share(probs, assumed: float, resamples: int = 200) -> dict:
    """The share of hallucinated answers among unlabelled answers with probabilities ``probs`` (which assume
    ``assumed``): :func:`estimate_prior`, with the 5th and 95th percentiles of its estimates on ``resamples``
    bootstrap resamples (seeded). Refuses fewer than :data:`MIN_FOR_SHARE` answers and an estimate at 0 or 1: the
    scores then do not look like the training answers in another proportion."""
    probs = np.asarray(probs, dtype=float)
    if len(probs) < MIN_FOR_SHARE:
        raise InputError(f"{len(probs)} answers are too few to estimate their share of hallucinated ones: give at "
                         f"least {MIN_FOR_SHARE}")
    estimate = estimate_prior(probs, assumed)
    if not 0.01 <= estimate <= 0.99:
        raise InputError(f"the scores of these {len(probs)} answers do not fit the training answers in another "
                         f"proportion (estimated share of hallucinated ones: {estimate:.3f}); state the share "
                         f"instead, or calibrate on labelled answers")
    rng, chunk = np.random.default_rng(0), max(1, 2_000_000 // len(probs))  # resamples at once: memory stays small
    found = np.concatenate([estimate_prior(probs[rng.integers(0, len(probs), size=(min(chunk, resamples - i),
                                                                                   len(probs)))], assumed)
                            for i in range(0, resamples, chunk)])
    low, high = np.percentile(found, [5, 95])
    return {"estimate": estimate, "interval": [float(low), float(high)], "n": int(len(probs))}


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


def conformal_threshold(grounded_scores, alpha: float) -> tuple[float, dict]:
    """Split-conformal decision threshold (Vovk et al.; Angelopoulos & Bates, "A Gentle Introduction to Conformal
    Prediction", section 1): with ``n`` scores of grounded answers, the threshold just above their
    ``k = ceil((n + 1)(1 - alpha))``-th smallest flags a new grounded answer exchangeable with them with probability
    at most ``alpha`` (flag when ``score >= threshold``). Returns the threshold and the guarantee's terms: ``n``,
    ``k``, ``bound`` (the exact marginal rate ``(n + 1 - k) / (n + 1)``) and ``fpr_90`` (the 90th percentile of the
    rate conditional on this calibration set, which follows Beta(n + 1 - k, k)). Needs ``n >= 1/alpha - 1``."""
    from scipy.stats import beta

    scores = np.sort(np.asarray(grounded_scores, dtype=float))
    n = len(scores)
    if not 0 < alpha < 1:
        raise InputError(f"the target false-positive rate must be in (0, 1), got {alpha}")
    k = int(np.ceil((n + 1) * (1 - alpha)))
    if k > n:
        raise InputError(f"{n} grounded answers cannot hold a false-positive rate of {alpha}: at least "
                         f"{int(np.ceil(1 / alpha - 1))} are needed")
    threshold = float(np.nextafter(scores[k - 1], np.inf))
    return threshold, {"n": n, "k": k, "bound": (n + 1 - k) / (n + 1),
                       "fpr_90": float(beta.ppf(0.9, n + 1 - k, k))}
