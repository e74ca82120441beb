"""A detector's operating point: how its raw score becomes a probability and a verdict.

The part a detector holds for this (:class:`OperatingPoint`) is the calibration of the raw score
(:class:`~halwatch.detectors.calibration.Calibrator`), the decision rule and the threshold it chose on the probe's
(held-out) probabilities, and the share of hallucinated answers the probabilities assume. Its artifact section is
the keys ``decision``, ``prior``, ``calibration`` and ``threshold``. It is fitted once on a detector's probe
(:meth:`OperatingPoint.fit`), and may be fitted again on a user's own labelled answers (:meth:`recalibrate`) or
restated for another share of hallucinated answers (:meth:`restate`) without touching the method.
"""

from __future__ import annotations

import numpy as np

from halwatch.detectors.calibration import Calibrator, best_f1_threshold, estimated_share
from halwatch.detectors.logistic import logit, sigmoid
from halwatch.errors import HalwatchError


def parse_decision(rule: str) -> tuple[str, float | None]:
    """A ``decision`` rule as ``(kind, target)``: ``"f1"`` -> ``("f1", None)``; ``"fpr=0.1"`` -> ``("fpr", 0.1)``
    (the share of the probe's grounded answers the threshold may flag); ``"mean-fpr=0.1"`` -> ``("mean-fpr", 0.1)``
    (the same share on average over the probe's datasets, each counted once whatever its size); ``"conformal
    fpr=0.1"`` (a threshold set by :meth:`OperatingPoint.recalibrate`) reads as ``fpr=0.1`` when refitted."""
    if rule == "f1":
        return "f1", None
    key, _, value = str(rule).removeprefix("conformal ").partition("=")
    try:
        target = float(value)
    except ValueError:
        target = -1.0
    if key not in ("fpr", "mean-fpr") or not 0 < target < 1:
        raise ValueError(f"decision: 'f1', 'fpr=A' or 'mean-fpr=A' with A in (0, 1), not {rule!r}")
    return key, target


def fpr_threshold(probs, labels, target: float, strata=None) -> float:
    """A threshold (predict 1 when ``prob >= t``) that flags as many grounded answers as a share ``target`` of
    them allows and no more: midway between the lowest grounded score it flags and the highest it does not.

    With ``strata`` (the dataset of each answer) the share is the mean over the strata of each stratum's share of
    grounded answers flagged: every grounded answer weighs ``1 / (strata x its stratum's grounded answers)``, so
    that a large set of answers that score low (short grounded answers) does not pull the threshold down for the
    others."""
    probs, labels = np.asarray(probs, dtype=float), np.asarray(labels)
    grounded = probs[labels == 0]
    if strata is None:
        weights = np.full(len(grounded), 1.0 / len(grounded))
    else:
        names, index, counts = np.unique(np.asarray(strata)[labels == 0], return_inverse=True, return_counts=True)
        weights = 1.0 / (len(names) * counts[index])
    order = np.argsort(-grounded, kind="stable")
    grounded, flagged = grounded[order], np.cumsum(weights[order])
    k = int(np.searchsorted(flagged, target * (1 + 1e-9), side="right"))  # the k highest may be flagged
    if k >= len(grounded):
        return float(grounded[-1])
    return float((grounded[k] + grounded[k - 1]) / 2) if k > 0 else float(np.nextafter(grounded[0], np.inf))


def operating_points(probs, labels, strata, threshold: float) -> dict:
    """Per stratum (dataset): its answers, its share hallucinated and the false- and true-positive rates at
    ``threshold`` of these (out-of-fold) probabilities."""
    probs, labels, strata = np.asarray(probs), np.asarray(labels), np.asarray(strata)
    out = {}
    for name in sorted(set(strata.tolist())):
        mine = strata == name
        flagged, y = probs[mine] >= threshold, labels[mine]
        out[name] = {"n": int(mine.sum()), "rate": round(float(y.mean()), 4),
                     "fpr": round(float(flagged[y == 0].mean()), 4) if (y == 0).any() else None,
                     "tpr": round(float(flagged[y == 1].mean()), 4) if (y == 1).any() else None}
    return out


class OperatingPoint:
    """The calibration, decision rule, threshold and assumed share of hallucinated answers of one detector (see
    the module docstring). ``calibration``: ``platt`` or ``isotonic``; ``decision``: :func:`parse_decision`'s
    rules; ``prior``: the share the probabilities assume (default: the probe's)."""

    def __init__(self, calibration: str = "platt", decision: str = "f1", prior: float | None = None):
        parse_decision(decision)
        if prior is not None and not 0 < float(prior) < 1:
            raise ValueError(f"prior: the share of hallucinated answers must be in (0, 1), not {prior}")
        self.decision, self.prior = decision, None if prior is None else float(prior)
        self.calibrator = Calibrator(calibration)
        self.threshold: float | None = None

    @property
    def fitted(self) -> bool:
        return self.threshold is not None

    def fit(self, raw, labels, oriented: bool, strata=None) -> np.ndarray:
        """Fit the calibration on (held-out) raw scores and the threshold on the probabilities it gives, under the
        decision rule (``strata``: each answer's dataset, for ``mean-fpr``). ``oriented``: the raw score already
        runs with the labels (a supervised method's), so a reversed slope is not turned round. Returns the
        probabilities."""
        self.calibrator.fit(raw, labels, oriented=oriented, prior=self.prior)
        probs = self.calibrator.transform(raw)
        kind, target = parse_decision(self.decision)
        self.threshold = (best_f1_threshold(probs, labels) if kind == "f1"
                          else fpr_threshold(probs, labels, target, strata if kind == "mean-fpr" else None))
        return probs

    def probabilities(self, raw) -> np.ndarray:
        return self.calibrator.transform(raw)

    def ranking(self, raw) -> np.ndarray:
        """The score answers are ranked by (:meth:`Calibrator.ranking`)."""
        return self.calibrator.ranking(raw)

    def as_fitted(self, probs):
        """Probabilities on the scale of the fit, before any restated prior (what a span rule fitted then reads)."""
        return self.calibrator.as_fitted(probs)

    def recalibrate(self, raw, labels, target_fpr: float | None, oriented: bool) -> dict:
        """Fit the probabilities and the threshold anew on a user's own labelled answers' raw scores: Platt (or
        isotonic) scaling on them, then with ``target_fpr`` the split-conformal threshold that holds that
        false-positive rate on answers like these (:func:`~halwatch.detectors.calibration.conformal_threshold`),
        else the best F1 on them. Returns what was reached on these answers and the guarantee's terms."""
        from halwatch.detectors.calibration import conformal_threshold

        labels = np.asarray(labels, dtype=int)
        raw = np.asarray(raw, dtype=float)
        calibrator = Calibrator(self.calibrator.method).fit(raw, labels, oriented=oriented)
        probs = calibrator.transform(raw)
        report: dict = {"n": int(len(labels)), "n_hallucinated": int(labels.sum())}
        if target_fpr is None:
            threshold = best_f1_threshold(probs, labels)
        else:
            threshold, guarantee = conformal_threshold(probs[labels == 0], target_fpr)
            # the guarantee's n counts the grounded answers: kept apart from the n of all answers
            report |= {"target_fpr": target_fpr, "n_grounded": guarantee.pop("n"), **guarantee}
        self.calibrator, self.threshold = calibrator, threshold
        self.decision = "f1" if target_fpr is None else f"conformal fpr={target_fpr}"
        flagged = probs >= threshold
        report |= {"threshold": threshold, "fpr": float(flagged[labels == 0].mean()),
                   "tpr": float(flagged[labels == 1].mean()) if labels.any() else None}
        return report

    def assumed_prior(self, name: str = "detector") -> float:
        """The share of hallucinated answers the probabilities assume."""
        if "prior" in self.calibrator.params:
            return float(self.calibrator.params["prior"])
        raise HalwatchError(f"detector {name!r}: the artifact does not say which share of hallucinated answers "
                            f"its probabilities assume; fit it again")

    def restate(self, prior: float | None = None, probs=None, name: str = "detector") -> dict:
        """Let the probabilities assume another share of hallucinated answers, keeping every verdict: the share
        ``prior`` stated, or the one estimated from ``probs`` (unlabelled answers' probabilities as scoring gives
        them, :func:`~halwatch.detectors.calibration.estimate_prior`, with a 90 % bootstrap interval). The
        calibrated log-odds move by ``logit(new) - logit(old)`` and the threshold with them."""
        report = {"assumed": self.assumed_prior(name)}
        if prior is None:
            report |= estimated_share(probs, report["assumed"])
            prior = report["estimate"]
        move = self.calibrator.restate(float(prior))
        self.threshold = float(sigmoid(logit(self.threshold) + move))
        return report | {"prior": float(prior), "threshold": self.threshold}

    def to_dict(self) -> dict:
        """The artifact section."""
        return {"decision": self.decision, "prior": self.prior, "calibration": self.calibrator.to_dict(),
                "threshold": self.threshold}

    @classmethod
    def from_dict(cls, d: dict, fitted_on: dict | None = None) -> "OperatingPoint":
        """From an artifact; one written before the assumed share was kept assumes its training answers' share
        (``fitted_on``'s counts)."""
        point = cls(d["calibration"]["method"], d.get("decision", "f1"), d.get("prior"))
        point.calibrator = Calibrator.from_dict(d["calibration"])
        point.threshold = d["threshold"]
        fitted_on = fitted_on or {}
        if "prior" not in point.calibrator.params and fitted_on.get("n"):
            point.calibrator.params["prior"] = fitted_on["n_hallucinated"] / fitted_on["n"]
        return point
