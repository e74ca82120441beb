"""Attention-based detectors besides TOHA: Lookback Lens, the attention-ratio baseline and LLM-Check's attention
score. All read per-head reducer outputs of the forward pass (``lookback.ratio``, ``diag.w``)."""

from __future__ import annotations

import numpy as np

from halwatch.detectors.base import Detector
from halwatch.detectors.calibration import fit_logistic, logistic_logodds
from halwatch.detectors.heads import select_heads
from halwatch.models.forward import SignalRequest


def _all_heads(detector):
    return detector._scorer().model.all_heads()


def mean_lookback(signals, heads) -> np.ndarray:
    """Response-level lookback feature: the time mean of each head's lookback ratio, ``[N, len(heads)]``."""
    return np.stack([s.head_values("lookback.ratio", heads).mean(axis=1) for s in signals])


class LookbackLens(Detector):
    """Lookback Lens (Chuang et al. 2024, section 2): the time-mean lookback ratio of every head, concatenated over
    layers and heads, standardised, into a logistic regression (max_iter 1000). Label 1 = hallucinated (the
    reference code's label 1 meant "not hallucinated"; here the classifier predicts hallucination directly).
    The raw score is the classifier's log-odds; token score: ``1 - `` the mean lookback ratio over heads."""

    name = "lookback-lens"
    citation = "Chuang et al., EMNLP 2024 (arXiv:2407.07071)"

    def __init__(self, scorer=None, calibration: str = "platt", C: float = 1.0, **settings):
        super().__init__(scorer=scorer, calibration=calibration, C=C, **settings)
        self.model: dict = {}

    def request(self):
        return SignalRequest(heads=_all_heads(self), reducers=("lookback",))

    def fit_method(self, signals, labels):
        self.model = fit_logistic(mean_lookback(signals, _all_heads(self)), labels, self.settings["C"])

    def raw_scores(self, signals):
        return logistic_logodds(self.model, mean_lookback(signals, _all_heads(self)))

    def token_scores(self, signals):
        heads = _all_heads(self)
        return [1.0 - s.head_values("lookback.ratio", heads).mean(axis=0).astype(float) for s in signals]

    def state(self):
        return {"model": self.model}

    def set_state(self, state):
        self.model = state["model"]


class AttentionRatio(Detector):
    """Attention-ratio baseline of TOHA (Table 10): the Lookback Lens feature (``1 -`` time-mean lookback ratio, so
    that larger means less attention on the context) with TOHA's head selection (Algorithm 1) instead of a
    classifier."""

    name = "attention-ratio"
    citation = "Bazarova et al., TOHA, Table 10 (features of Chuang et al. 2024)"

    def __init__(self, scorer=None, calibration: str = "platt", n_max: int = 10, **settings):
        super().__init__(scorer=scorer, calibration=calibration, n_max=n_max, **settings)
        self.heads: list[tuple[int, int]] | None = None

    def request(self):
        heads = self.heads if self.heads is not None else _all_heads(self)
        return SignalRequest(heads=tuple(map(tuple, heads)), reducers=("lookback",))

    def fit_method(self, signals, labels):
        heads = _all_heads(self)
        order, _, n_opt = select_heads(1.0 - mean_lookback(signals, heads), labels, self.settings["n_max"])
        self.heads = [heads[i] for i in order[:n_opt]]

    def raw_scores(self, signals):
        return (1.0 - mean_lookback(signals, self.heads)).mean(axis=1)

    def state(self):
        return {"heads": [list(h) for h in self.heads]}

    def set_state(self, state):
        self.heads = [tuple(h) for h in state["heads"]]


class LLMCheckAttention(Detector):
    """LLM-Check attention score (Sriramanan et al., NeurIPS 2024): the log-determinant of a head's (lower
    triangular) attention kernel is the sum of the log of its diagonal; averaged here over tokens and over all
    heads of all layers. Only response rows are captured, so the diagonal is that of the response tokens (the
    original also includes the prompt's). Its orientation is fitted with the calibration on probe data."""

    name = "llm-check"
    citation = "Sriramanan et al., NeurIPS 2024 (LLM-Check), attention score"

    def request(self):
        return SignalRequest(heads=_all_heads(self), reducers=("diag",))

    def raw_scores(self, signals):
        heads = _all_heads(self)
        return np.array([float(np.log(np.clip(s.head_values("diag.w", heads), 1e-12, None)).mean())
                         for s in signals])
