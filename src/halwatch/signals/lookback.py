"""Lookback ratio (Chuang et al. 2024, "Lookback Lens", section 2.1): per head and response step, the share of
attention on the context versus the tokens generated so far.

With teacher forcing, the row of response token ``r`` (absolute position ``n_prompt + r``) is the query of the step
that generates token ``r + 1``; the tokens generated so far are response positions ``n_prompt .. n_prompt + r``
(the query token included, as in generation, where the newest token attends to itself). For that step

    ratio = mean(w[:n_prompt]) / (mean(w[:n_prompt]) + mean(w[n_prompt : n_prompt + r + 1]))

All "context" here is the whole prompt (the template and question included), as in the reference code, where the
context is everything before the first generated token.
"""

from __future__ import annotations

import numpy as np


def lookback_ratios(rows, n_prompt: int) -> np.ndarray:
    """Lookback ratio of every head at every response step: ``rows[H, R, n]`` (response rows) -> ``[H, R]``."""
    rows = np.asarray(rows, dtype=np.float64)
    if rows.ndim != 3 or n_prompt <= 0 or rows.shape[2] != n_prompt + rows.shape[1]:
        raise ValueError(f"expected rows [H, R, n_prompt + R] with n_prompt > 0, got {rows.shape}, {n_prompt}")
    n_resp = rows.shape[1]
    on_context = rows[:, :, :n_prompt].mean(axis=2)
    generated = np.tril(np.ones((n_resp, n_resp)))  # row r covers response tokens 0..r
    on_new = np.einsum("hrk,rk->hr", rows[:, :, n_prompt:], generated) / np.arange(1, n_resp + 1)
    total = on_context + on_new
    return np.divide(on_context, total, out=np.full_like(total, 0.5), where=total > 0)


def window_starts(n_response: int, window: int, stride: int) -> np.ndarray:
    """First token of each sliding window of ``window`` response tokens, ``stride`` apart; the last window always
    ends at the last token, and a response shorter than a window is one window."""
    if window < 1 or stride < 1:
        raise ValueError(f"window and stride must be at least 1, got {window} and {stride}")
    last = max(n_response - window, 0)
    starts = list(range(0, last + 1, stride))
    if starts[-1] != last:
        starts.append(last)
    return np.array(starts)


def window_means(values, window: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean of ``values[H, R]`` over each sliding window of response tokens (Lookback Lens section 2.2, span-level
    detector): ``(starts [W], features [W, H])``."""
    values = np.asarray(values, dtype=np.float64)
    starts = window_starts(values.shape[1], window, stride)
    ends = np.minimum(starts + window, values.shape[1])
    total = np.concatenate([np.zeros((values.shape[0], 1)), np.cumsum(values, axis=1)], axis=1)
    return starts, ((total[:, ends] - total[:, starts]) / (ends - starts)).T
