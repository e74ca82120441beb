"""Pure functions of one forward pass (no labels, no fitting), and the attention reducers they register.

A reducer turns the captured attention rows of some heads, ``rows[H, Q, n]`` (queries from ``row_start``), into
per-head arrays inside the forward pass, so the rows need not be kept.
"""

from __future__ import annotations

import numpy as np

from halwatch.models.forward import SignalRequest, register_reducer
from halwatch.signals.lookback import lookback_ratios
from halwatch.signals.topology import mst_length, mtopdiv


@register_reducer("mtopdiv")
def _mtopdiv_reducer(rows, n_prompt: int, row_start: int) -> dict:
    """MTop-Div_G(R, P) per head (TOHA, Prop. 3.1 and eq. 3): ``d`` [H] and ``token_weights`` [H, R]."""
    result = mtopdiv(rows[:, n_prompt - row_start :, :], n_prompt)
    return {"d": result.d.astype("float32"), "token_weights": result.token_weights.astype("float32")}


@register_reducer("lookback")
def _lookback_reducer(rows, n_prompt: int, row_start: int) -> dict:
    """Lookback ratio per head and response step (Lookback Lens, section 2.1): ``ratio`` [H, R]."""
    return {"ratio": lookback_ratios(rows[:, n_prompt - row_start :, :], n_prompt).astype("float32")}


@register_reducer("diag")
def _diag_reducer(rows, n_prompt: int, row_start: int) -> dict:
    """Attention of each response token on itself, ``w`` [H, R] (the diagonal used by LLM-Check's attention score,
    Sriramanan et al. 2024)."""
    resp = rows[:, n_prompt - row_start :, :]
    idx = np.arange(resp.shape[1])
    return {"w": resp[:, idx, n_prompt + idx].astype("float32")}


@register_reducer("mst")
def _mst_reducer(rows, n_prompt: int, row_start: int) -> dict:
    """Length of the MST of the complete attention graph, normalised by |R| (TOHA section 4.4, Table 4 ablation):
    ``d`` [H]. Needs the rows of every token (``attention_from="all"``)."""
    if row_start != 0:
        raise ValueError("the 'mst' reducer needs attention rows of every token (attention_from='all')")
    return {"d": mst_length(rows, n_prompt).d.astype("float32")}


def whitebox_request(model) -> SignalRequest:
    """One forward pass that feeds every white-box detector and baseline: token statistics, pooled hidden states of
    the middle and last layer (linear probe), and for every head the MTop-Div (TOHA), the lookback ratios (Lookback
    Lens) and the attention diagonal (LLM-Check). Benchmarks always ask for exactly this, and the scorer serves any
    request it covers from its cached entries, so detectors, protocols and reruns share one pass per answer."""
    return SignalRequest(
        token_stats=True,
        hidden_layers=(model.n_layers // 2, model.n_layers),
        hidden_pool="mean_last",
        heads=model.all_heads(),
        reducers=("diag", "lookback", "mtopdiv"),
    )
