"""Lookback ratio (Chuang et al. 2024, "Lookback Lens", section 2.1), NumPy reference, and the sliding windows of
the span-level detector (section 2.2).

The ratio of a head at the decoding step that generates response token ``y_i`` is the share of its attention on
the context against the tokens generated so far. The query of that step is the token before ``y_i`` (the last
prompt token for ``y_0``), as in the reference implementation, where the features of each new token come from the
attention row of the pass that produced it. The answer header (``\noutput:``, ``\nAnswer:``, the chat template's
assistant header) counts as new tokens, as the reference's ``\n#Answer#:`` does. With the query at position
``q_i = n_prompt - 1 + i`` and ``c = n_prompt - max(n_header, 1)`` context tokens:

    ratio_i = mean(w[:c]) / (mean(w[:c]) + mean(w[c : q_i + 1]))

The forward pass computes this in torch (:func:`halwatch.signals.reducers.lookback`); this function, written
directly from the formula, is the reference the tests compare it with; :func:`copy_mass` is the same for the copy
reducer (:func:`halwatch.signals.reducers.copy`), which reads the same rows.
"""

from __future__ import annotations

import numpy as np


def lookback_ratios(step_rows, n_prompt: int, n_header: int = 0) -> np.ndarray:
    """Lookback ratio of every head at every response step: ``step_rows[H, R, n]`` (row ``i`` = the query at
    position ``n_prompt - 1 + i``, over all ``n = n_prompt + R`` keys) -> ``[H, R]``."""
    rows = np.asarray(step_rows, dtype=np.float64)
    if rows.ndim != 3 or n_prompt <= 0 or rows.shape[2] != n_prompt + rows.shape[1]:
        raise ValueError(f"expected rows [H, R, n_prompt + R] with n_prompt > 0, got {rows.shape}, {n_prompt}")
    n_resp = rows.shape[1]
    c = n_prompt - max(n_header, 1)
    out = np.empty(rows.shape[:2])
    for i in range(n_resp):
        query = n_prompt - 1 + i
        on_context = rows[:, i, :c].mean(axis=1) if c > 0 else np.zeros(rows.shape[0])
        on_new = rows[:, i, c : query + 1].mean(axis=1)
        total = on_context + on_new
        out[:, i] = np.divide(on_context, total, out=np.full_like(total, 0.5), where=total > 0)
    return out


def copy_mass(step_rows, input_ids, n_prompt: int, n_header: int = 0) -> np.ndarray:
    """Attention of every head's step ``i`` (rows as :func:`lookback_ratios` takes them) on the context tokens equal
    to the response token ``y_i = input_ids[n_prompt + i]`` it generates, the context being the first
    ``n_prompt - max(n_header, 1)`` tokens -> ``[H, R]``."""
    rows = np.asarray(step_rows, dtype=np.float64)
    ids = np.asarray(input_ids)
    c = n_prompt - max(n_header, 1)
    out = np.zeros(rows.shape[:2])
    for i in range(rows.shape[1]):
        same = np.flatnonzero(ids[:c] == ids[n_prompt + i])
        out[:, i] = rows[:, i, same].sum(axis=1)
    return out


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
