"""halwatch's one logistic function and its inverse."""

from __future__ import annotations

import numpy as np


def logit(p):
    """Log-odds of probabilities (clipped away from 0 and 1)."""
    p = np.clip(np.asarray(p, dtype=float), 1e-12, 1 - 1e-12)
    return np.log(p / (1 - p))


def sigmoid(z):
    """The logistic function, the inverse of :func:`logit` (SciPy's ``expit``, exact in both tails)."""
    from scipy.special import expit

    return expit(z)
