"""Baselines computed from the response tokens' predictive distributions (one forward pass, no attention).

Each is unsupervised; its raw score is oriented so that higher means more likely hallucinated, and only the
calibration and thresholds are fitted on probe data.
"""

from __future__ import annotations

import numpy as np

from halwatch.detectors.base import Detector
from halwatch.models.forward import SignalRequest

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
