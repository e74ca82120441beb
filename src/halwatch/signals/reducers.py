"""Per-head reducers: functions that turn the attention rows of some heads of one sample into small per-head signals
inside the forward pass, in torch, on the model's device, so that the rows never leave it.

The forward pass (:mod:`halwatch.models.forward`) hands every reducer the same :class:`Rows`: the softmax rows of
``H`` heads for the queries at positions ``row_start .. n - 1`` over every key (float32). With
``attention_from="response"`` the rows begin at the last prompt token (``row_start = n_prompt - 1``): Lookback Lens
reads the rows of the queries that *generate* each response token (the last prompt token for the first one), while
TOHA, the diagonal and the sink read the rows of the response tokens themselves.

Each reducer has a version, part of the signal-cache key (:mod:`halwatch.cache`): a change to a definition bumps its
version, so that old cached values are never reused for the new definition.

The NumPy functions of :mod:`halwatch.signals.lookback` and :mod:`halwatch.signals.topology` are the references the
tests compare these with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class Rows:
    """Attention rows of ``H`` heads of one sample: ``probs[H, Q, n]`` for the queries at ``row_start ..
    row_start + Q - 1`` (``n`` = tokens of the sample). ``n_prompt`` tokens are the prompt; its last ``n_header``
    tokens are the answer header (the ``\\noutput:`` line, or the chat template's assistant header), which Lookback
    Lens counts with the new tokens, not with the context."""

    probs: object  # torch.Tensor
    n_prompt: int
    n_header: int
    row_start: int

    @property
    def n_response(self) -> int:
        return self.probs.shape[-1] - self.n_prompt

    def of_queries(self, first: int, last: int):
        """Rows of the queries at absolute positions ``first .. last - 1``."""
        if first < self.row_start:
            raise ValueError(f"rows begin at query {self.row_start}, asked from {first}")
        return self.probs[:, first - self.row_start : last - self.row_start]

    def response(self):
        """``[H, R, n]``: the rows of the response tokens themselves."""
        return self.of_queries(self.n_prompt, self.probs.shape[-1])

    def steps(self):
        """``[H, R, n]``: the rows of the queries that generate each response token (position ``n_prompt - 1 + i``
        for response token ``i``)."""
        return self.of_queries(self.n_prompt - 1, self.probs.shape[-1] - 1)


@dataclass(frozen=True)
class Reducer:
    """``fn(rows) -> {field: tensor [H, ...]}``. A reducer with ``finish`` is split in two: ``fn`` returns a partial
    result per layer (cheap, e.g. distances), and ``finish([partials of consecutive layers])`` turns several
    layers' partials into their fields at once (the forward pass batches them up to a memory budget), for work whose
    cost is in its number of steps rather than their size (Prim's algorithm)."""

    fn: Callable
    version: int
    needs_all_rows: bool = False
    finish: Callable | None = None


REDUCERS: dict[str, Reducer] = {}


def reducer(name: str, version: int, needs_all_rows: bool = False, finish: Callable | None = None):
    def wrap(fn):
        REDUCERS[name] = Reducer(fn, version, needs_all_rows, finish)
        return fn

    return wrap


def versions(names) -> dict[str, int]:
    """The version of each named reducer (for cache keys)."""
    return {name: REDUCERS[name].version for name in names}


@reducer("lookback", version=2)
def lookback(rows: Rows) -> dict:
    """Lookback ratio of every head at every response step (Lookback Lens, section 2.1): ``ratio [H, R]``.

    Step ``i`` is the decoding step that generates response token ``y_i``; its query is the token before ``y_i``
    (the last prompt token for ``y_0``), as in the reference implementation (``step01_extract_attns.py``: the
    attention row ``[-1]`` of the pass that produced each new token). The context is the prompt without the answer
    header (the reference's ``context_length = input length - len("\\n#Answer#:")``); the new tokens are the
    header and the response tokens before ``y_i``, up to the query itself:

        ratio_i = mean(w_i[:c]) / (mean(w_i[:c]) + mean(w_i[c : q_i + 1])),   c = n_prompt - max(n_header, 1)

    With no header the last prompt token stands in for it, so that the query is always a new token (the reference
    always has one). Only sums over the row are needed: O(H R n), no R x R product.
    """
    import torch

    w = rows.steps()
    n_ctx = rows.n_prompt - max(rows.n_header, 1)
    queries = torch.arange(rows.n_prompt - 1, rows.n_prompt - 1 + w.shape[1], device=w.device)
    on_context = w[..., :n_ctx].sum(-1) / n_ctx if n_ctx > 0 else torch.zeros(w.shape[:2], device=w.device)
    on_new = w[..., max(n_ctx, 0):].sum(-1) / (queries - n_ctx + 1).to(w.dtype)
    total = on_context + on_new
    return {"ratio": torch.where(total > 0, on_context / total.clamp_min(1e-30), torch.full_like(total, 0.5))}


@reducer("diag", version=1)
def diag(rows: Rows) -> dict:
    """Attention of each response token on itself, ``w [H, R]`` (the diagonal of LLM-Check's attention score,
    Sriramanan et al. 2024)."""
    import torch

    w = rows.response()
    r = torch.arange(w.shape[1], device=w.device)
    return {"w": w[:, r, rows.n_prompt + r]}


@reducer("sink", version=1)
def sink(rows: Rows) -> dict:
    """Attention of each response token on the first token of the input (the attention sink), ``w [H, R]``."""
    return {"w": rows.response()[..., 0]}


def _prim(dist, key):
    """Dense Prim's algorithm vectorised over heads, grown from a root already in the tree: ``dist [H, N, N]``
    symmetric distances between the other nodes, ``key [H, N]`` their distances to the root. Returns the weight of
    the edge by which each node joins the tree, ``[H, N]``."""
    import torch

    n_heads, n = key.shape
    heads = torch.arange(n_heads, device=key.device)
    key = key.clone()
    blocked = torch.zeros_like(key)
    weights = torch.empty_like(key)
    for _ in range(n):
        j = torch.argmin(key + blocked, dim=1)
        weights[heads, j] = key[heads, j]
        blocked[heads, j] = float("inf")
        key = torch.minimum(key, dist[heads, j] + blocked)
    return weights


def _distance(w):
    return 1.0 - w.clamp(0.0, 1.0)


def _mtopdiv_finish(partials: list[dict]) -> dict:
    """Prim's algorithm once for the heads of several layers (their root and pairwise distances)."""
    import torch

    weights = _prim(torch.cat([p["dist"] for p in partials]), torch.cat([p["key"] for p in partials]))
    return {"d": weights.sum(-1) / weights.shape[1], "token_weights": weights}


@reducer("mtopdiv", version=1, finish=_mtopdiv_finish)
def mtopdiv(rows: Rows) -> dict:
    """MTop-Div_G(R, P) of every head (TOHA, Prop. 3.1 and eq. 3): the weight of the minimum spanning forest that
    attaches the response tokens to the prompt, with the prompt contracted to one root (distance ``1 - max_p w_rp``,
    since a prompt token never attends to a response token) and response-response distances ``1 - max(w_ab,
    w_ba)``. ``d [H]`` = MTop-Div / |R| and ``token_weights [H, R]``, the forest edge by which each response token
    is attached. See :func:`halwatch.signals.topology.mtopdiv` (the NumPy reference). Per layer only the
    distances are computed; Prim's algorithm runs on the heads of several layers at once (:func:`_mtopdiv_finish`).
    """
    w = rows.response()
    block = w[..., rows.n_prompt:]
    return {"key": _distance(w[..., :rows.n_prompt].amax(-1)), "dist": _distance(block.maximum(block.transpose(1, 2)))}


@reducer("mst", version=1, needs_all_rows=True)
def mst(rows: Rows) -> dict:
    """Length of the minimum spanning tree of the complete attention graph (prompt-prompt distances kept), over
    |R|: TOHA's ablation (section 4.4, Table 4), ``d [H]``. Needs the rows of every token."""
    if rows.row_start != 0:
        raise ValueError("the 'mst' reducer needs attention rows of every token (attention_from='all')")
    w = rows.probs
    if w.shape[-1] == 1:
        return {"d": w.new_zeros(w.shape[0])}
    sym = w.maximum(w.transpose(1, 2))
    weights = _prim(_distance(sym[:, 1:, 1:]), _distance(sym[:, 0, 1:]))
    return {"d": weights.sum(-1) / rows.n_response}
