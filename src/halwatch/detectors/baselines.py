"""Baselines computed from the response tokens' predictive distributions (one forward pass, no attention).

Each is unsupervised; its raw score is oriented so that higher means more likely hallucinated, and only the
calibration and thresholds are fitted on probe data.
"""

from __future__ import annotations

import numpy as np

from halwatch.detectors import linear
from halwatch.detectors.base import Detector
from halwatch.models.signal_types import SignalRequest

TOKEN_STATS = SignalRequest(token_stats=True)


class Perplexity(Detector):
    """Mean negative log-likelihood of the response tokens (log-perplexity); Ren et al. 2023, "Out-of-distribution
    detection and selective generation for conditional language models" (the perplexity baseline of TOHA, Table 1).
    Token score: the token's negative log-likelihood."""

    name = "perplexity"
    citation = "Ren et al., ICLR 2023 (arXiv:2209.15558)"

    def request(self):
        return TOKEN_STATS

    def raw_scores(self, signals):
        return np.array([-float(np.mean(s.logprobs)) for s in signals])

    def token_scores(self, signals):
        return [-s.logprobs.astype(float) for s in signals]


class MaxEntropy(Detector):
    """Largest entropy of the predictive distribution over the response tokens; Malinin & Gales 2021, "Uncertainty
    estimation in autoregressive structured prediction" (the max-entropy baseline of TOHA, Table 1).
    Token score: the token's predictive entropy."""

    name = "max-entropy"
    citation = "Malinin & Gales, ICLR 2021 (arXiv:2002.07650)"

    def request(self):
        return TOKEN_STATS

    def raw_scores(self, signals):
        return np.array([float(np.max(s.entropy)) for s in signals])

    def token_scores(self, signals):
        return [s.entropy.astype(float) for s in signals]


class MeanEntropy(MaxEntropy):
    """Mean predictive entropy over the response tokens; Malinin & Gales 2021 (as :class:`MaxEntropy`)."""

    name = "mean-entropy"

    def raw_scores(self, signals):
        return np.array([float(np.mean(s.entropy)) for s in signals])


class ResponseLength(Detector):
    """Response length in tokens: not a detector but the confound every detector must beat (longer RAGTruth
    answers are more often hallucinated; attention signals correlate with length, DESIGN.md)."""

    name = "length"
    citation = "confound baseline"

    def request(self):
        return SignalRequest()

    def raw_scores(self, signals):
        return np.array([float(s.n_response) for s in signals])


class LinearProbe(Detector):
    """Linear probe on hidden states (TOHA Table 11; Azaria & Mitchell 2023): a logistic regression on the
    standardised mean over response tokens of the middle layer's hidden state, trained on the probe data; its
    regularisation chosen by cross-validation on the probe (``C="cv"``, 576 features against 100-2,500 answers)
    and its calibration fitted out of fold."""

    name = "linear-probe"
    citation = "Azaria & Mitchell, Findings of EMNLP 2023; TOHA Table 11"
    supervised = True

    def __init__(self, scorer=None, calibration: str = "platt", C: float | str = "cv", **settings):
        super().__init__(scorer=scorer, calibration=calibration, C=C, **settings)
        self.model: dict = {}

    def _layer(self) -> int:
        return self.get_scorer().model.n_layers // 2

    def request(self):
        return SignalRequest(hidden_layers=(self._layer(),), hidden_pool="mean_last")

    def _features(self, signals):
        layer = self._layer()
        return np.stack([s.hidden[s.hidden_layers.index(layer), 0] for s in signals]).astype(float)

    def fit_method(self, signals, labels):
        self.model = linear.fit(self._features(signals), labels, C=self.settings["C"])

    def fold_copy(self):
        copy = super().fold_copy()
        copy.settings["C"] = self.model["C"]
        return copy

    def raw_scores(self, signals):
        return linear.logodds(self.model, self._features(signals))

    def state(self):
        return {"model": self.model}

    def set_state(self, state):
        self.model = state["model"]
