"""Relevance statistics of LRP4RAG section 3.3: mean resampling to a fixed length (eq. 7-9), in one and two
dimensions, and the normalisation of a relevance vector to (0, 1) (sections 4.2 and 4.4)."""

from __future__ import annotations

import numpy as np

#: The stabiliser of the normalisation, "epsilon 1e-6 when normalizing the relevance scores" (section 4.2).
EPSILON = 1e-6


def resample_bounds(i, n_old, n_new) -> tuple[np.ndarray, np.ndarray]:
    """``(start_i, end_i)`` of eq. 9 for new index ``i`` (0-based; arrays broadcast): old values ``start_i ..
    end_i - 1`` make new value ``i``.

    ``rho = n_old / n_new`` (eq. 7) is never formed: ``start_i = floor(i rho) = (i n_old) // n_new`` and ``end_i =
    floor((i + 1) rho) = ((i + 1) n_old) // n_new`` in exact integer arithmetic. (In floating point ``(i + 1) rho``
    can round below an integer it equals, e.g. ``100 * (113 / 100) = 112.99999999999999``: the last old value then
    fell out of every range and got weight zero.) Shrinking (``n_old >= n_new``), the ranges partition the old
    values, none empty. Stretching, a range can be empty; it then takes the old value at ``start_i``, so every new
    value is an old value or a mean of old values, never a zero. Since ``i < n_new``, ``start_i <= n_old - 1``
    and ``end_i <= n_old``: no range runs past the end, so the paper's padding with the last value is never needed.
    """
    i, n_old, n_new = (np.asarray(a, dtype=np.int64) for a in (i, n_old, n_new))
    start = (i * n_old) // n_new
    end = np.maximum(((i + 1) * n_old) // n_new, start + 1)
    return start, end


def resample_matrix(n_old: int, n_new: int) -> np.ndarray:
    """The linear map of eq. 7-9 from ``n_old`` values to ``n_new``, ``[n_new, n_old]``: row ``i`` is the mean over
    the range of :func:`resample_bounds` (eq. 8), so every row sums to 1."""
    if n_old < 1 or n_new < 1:
        raise ValueError(f"resampling needs at least one value on each side, got {n_old} -> {n_new}")
    start, end = resample_bounds(np.arange(n_new), n_old, n_new)
    cols = np.arange(n_old)
    inside = (cols[None, :] >= start[:, None]) & (cols[None, :] < end[:, None])
    return inside / (end - start)[:, None].astype(float)


def resample(values, n_new: int) -> np.ndarray:
    """Mean resampling of a 1-D vector to ``n_new`` values (eq. 7-9)."""
    values = np.asarray(values, dtype=float)
    return resample_matrix(len(values), n_new) @ values


def resample_2d(matrix, n_rows: int, n_cols: int) -> np.ndarray:
    """Mean resampling of a matrix along both dimensions (section 3.3, last sentence)."""
    matrix = np.asarray(matrix, dtype=float)
    return resample_matrix(matrix.shape[0], n_rows) @ matrix @ resample_matrix(matrix.shape[1], n_cols).T


def normalise(values) -> np.ndarray:
    """Min-max normalisation of relevance to [0, 1): ``(R - min R) / (max R - min R + epsilon)`` with ``epsilon =
    1e-6`` (section 4.2), over the whole array (a vector, or a matrix as one). The paper normalises relevance "to
    the interval (0, 1)" (section 4.4) and names the epsilon (section 4.2), not the formula; this is min-max with
    the epsilon in the denominator, so a constant vector becomes zeros. Mean resampling (eq. 7-9, rows summing to 1)
    commutes with this affine map but not with the choice of min and max: normalising before resampling takes them
    from the relevance itself, after resampling from the resampled values."""
    values = np.asarray(values, dtype=float)
    if values.size == 0:
        return values
    low = values.min()
    return (values - low) / (values.max() - low + EPSILON)
