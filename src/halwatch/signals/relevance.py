"""Relevance statistics of LRP4RAG section 3.3: mean resampling to a fixed length (eq. 7-9), in one and two
dimensions."""

from __future__ import annotations

import numpy as np


def resample_matrix(n_old: int, n_new: int) -> np.ndarray:
    """The linear map of eq. 7-9 from ``n_old`` values to ``n_new``, ``[n_new, n_old]``.

    ``rho = n_old / n_new`` (eq. 7); value ``i`` is the mean of the old values ``start_i .. end_i - 1`` with
    ``start_i = floor(i rho)`` and ``end_i = floor((i + 1) rho)`` (eq. 8-9, written 0-based). When stretching
    (``rho < 1``) a range can be empty; it then takes the old value at ``start_i``, so every new value is an old
    value or a mean of old values (never a zero), and past the end the last old value repeats.
    """
    if n_old < 1 or n_new < 1:
        raise ValueError(f"resampling needs at least one value on each side, got {n_old} -> {n_new}")
    rho = n_old / n_new
    out = np.zeros((n_new, n_old))
    for i in range(n_new):
        start = min(int(np.floor(i * rho)), n_old - 1)
        end = min(max(int(np.floor((i + 1) * rho)), start + 1), n_old)
        out[i, start:end] = 1.0 / (end - start)
    return out


def resample(values, n_new: int) -> np.ndarray:
    """Mean resampling of a 1-D vector to ``n_new`` values (eq. 7-9)."""
    values = np.asarray(values, dtype=float)
    return resample_matrix(len(values), n_new) @ values


def resample_2d(matrix, n_rows: int, n_cols: int) -> np.ndarray:
    """Mean resampling of a matrix along both dimensions (section 3.3, last sentence)."""
    matrix = np.asarray(matrix, dtype=float)
    return resample_matrix(matrix.shape[0], n_rows) @ matrix @ resample_matrix(matrix.shape[1], n_cols).T
