"""Per-head reducers: functions that turn the attention rows of some heads of a batch of samples into small per-head
signals inside the forward pass, in torch, on the model's device, so that the rows never leave it.

The forward pass (:mod:`halwatch.models.forward`) hands every reducer the same :class:`Rows` for one layer: the
softmax rows of ``H`` heads of the ``B`` samples of a batch, each sample's rows starting at its own query position
(float32). With ``attention_from="response"`` a sample's rows begin at its last prompt token (``row_start =
n_prompt - 1``): Lookback Lens reads the rows of the queries that *generate* each response token (the last prompt
token for the first one), while TOHA, the diagonal and the sink read the rows of the response tokens themselves.

A reducer works on the whole batch at once, with no loop over samples: every field it returns is ``[B, H]`` or
``[B, H, R_max]`` (one value per response token, ``R_max`` the longest response of the batch; the entries past a
sample's own ``R`` are padding, which the forward pass cuts off).

Each reducer has a version, part of the signal-cache key (:mod:`halwatch.cache`): a change to a definition bumps its
version, so that old cached values are never reused for the new definition.

The NumPy functions of :mod:`halwatch.signals.lookback` and :mod:`halwatch.signals.topology` are the references the
tests compare these with, one sample at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from halwatch.signals import prim_kernel


def on_device(values, device, dtype=None):
    """A tensor of ``values`` (a sequence or NumPy array; ``long`` unless ``dtype``) on ``device``, copied without
    a wait: a plain copy from host memory waits for the device's queue to empty, which on a GPU stalls the host
    once per copy instead of letting it queue the next kernels (CUDA stages a pageable buffer before the call
    returns, so the host array may go)."""
    import torch

    tensor = torch.as_tensor(values, dtype=torch.long if dtype is None else dtype)
    return tensor.to(device, non_blocking=True)


@dataclass
class Rows:
    """Attention rows of ``H`` heads of ``B`` samples: ``probs[B, H, Q, K]``. Row ``i`` of sample ``b`` is the
    query at absolute position ``row_start[b] + i``; sample ``b`` has ``length[b]`` tokens, of which the first
    ``n_prompt[b]`` are the prompt, whose last ``n_header[b]`` tokens are the answer header (the ``\\noutput:``
    line, or the chat template's assistant header), which Lookback Lens counts with the new tokens, not with the
    context. Rows past a sample's last query repeat real rows, and keys past its length weigh 0: padding.
    ``ids`` holds each sample's token ids, for reducers that compare keys with the tokens generated (``copy``).

    The layout (the four tuples of ints) is the batch's; the forward pass sets ``probs`` for each layer, and the
    layout's tensors on the device are made once per batch (:meth:`tensor`)."""

    n_prompt: tuple
    n_header: tuple
    row_start: tuple
    length: tuple
    probs: object = None  # torch.Tensor [B, H, Q, K]
    device: object = None  # where the layout's tensors go when there are no ``probs`` (the GPU kernel's path)
    ids: tuple = ()  # each sample's token ids (a sequence of ints per sample, read only by reducers that ask)

    def __post_init__(self):
        self._tensors = {}
        self._of_queries = {}  # first -> rows of those queries, for the current probs

    def __setattr__(self, name, value):
        if name == "probs":  # a new layer's rows: the rows picked from the last layer's go
            self.__dict__.setdefault("_of_queries", {}).clear()
        super().__setattr__(name, value)

    @property
    def r_max(self) -> int:
        """The longest response of the batch."""
        return max(n - p for n, p in zip(self.length, self.n_prompt))

    def tensor(self, name: str):
        """``[B]`` long tensor of a layout field (or ``n_response``) on the device of ``probs``; ``"ids"``: the
        token ids ``[B, max length]``, -1 past a sample's length."""

        key = (name, self.where)
        if key not in self._tensors:
            if name == "ids":
                longest = max(self.length)
                values = [list(ids) + [-1] * (longest - len(ids)) for ids in self.ids]
            else:
                values = ([n - p for n, p in zip(self.length, self.n_prompt)] if name == "n_response"
                          else getattr(self, name))
            self._tensors[key] = on_device(values, self.where)
        return self._tensors[key]

    @property
    def where(self):
        """The device of ``probs``, or ``device`` without them."""
        return self.device if self.probs is None else self.probs.device

    def valid(self):
        """``[B, R_max]`` bool: response token ``i`` exists in sample ``b``."""
        import torch

        return torch.arange(self.r_max, device=self.where)[None, :] < self.tensor("n_response")[:, None]

    def padding(self, heads: int):
        """``[B, heads, R_max]``: Prim's ``blocked`` of the response tokens (:func:`_padding` of :meth:`valid`),
        the same for every layer of the batch: made once."""
        key = ("blocked", heads, self.where)
        if key not in self._tensors:
            self._tensors[key] = _padding(self.valid(), heads)
        return self._tensors[key]

    def of_queries(self, first: tuple):
        """``[B, H, R_max, K]``: the rows of the queries at absolute positions ``first[b] + i``, ``i < R_max``
        (positions past a sample's rows repeat its last row). Picked once per layer: every reducer that asks for
        the same queries gets the same tensor."""
        import torch

        if first in self._of_queries:
            return self._of_queries[first]
        b, h, q, k = self.probs.shape
        index = [f - s for f, s in zip(first, self.row_start)]
        if len(set(index)) == 1 and index[0] + self.r_max <= q:  # one slice serves every sample
            out = self.probs[:, :, index[0]:index[0] + self.r_max]
        else:
            key = ("first", first, q, self.probs.device)
            if key not in self._tensors:
                start = on_device(index, self.probs.device)
                self._tensors[key] = (start[:, None] + torch.arange(self.r_max, device=start.device)[None, :]
                                      ).clamp(0, q - 1)
            index = self._tensors[key]
            out = self.probs.gather(2, index[:, None, :, None].expand(b, h, self.r_max, k))
        self._of_queries[first] = out
        return out

    def response(self):
        """``[B, H, R_max, K]``: the rows of the response tokens themselves."""
        return self.of_queries(self.n_prompt)

    def steps(self):
        """``[B, H, R_max, K]``: the rows of the queries that generate each response token (position ``n_prompt -
        1 + i`` for response token ``i``)."""
        return self.of_queries(tuple(p - 1 for p in self.n_prompt))

    def response_keys(self, w, diagonal: bool = False):
        """The weights of rows ``w [B, H, R_max, K]`` on the response tokens' keys (``n_prompt[b] + j``):
        ``[B, H, R_max, R_max]``, columns past a sample's response being padding; with ``diagonal``, only each
        row's own column ``j = i``, ``[B, H, R_max]``."""
        import torch

        b, h, r, k = w.shape
        keys = (self.tensor("n_prompt")[:, None] + torch.arange(r, device=w.device)[None, :]).clamp(max=k - 1)
        if diagonal:
            return w.gather(3, keys[:, None, :, None].expand(b, h, r, 1))[..., 0]
        return w.gather(3, keys[:, None, None, :].expand(b, h, r, r))


@dataclass(frozen=True)
class Reducer:
    """``fn(rows) -> {field: tensor [B, H, ...]}``. A reducer with ``finish`` is split in two: ``fn`` returns a
    partial result per layer (cheap, e.g. distances; every field ``[B, H, ...]``), and ``finish([partials of
    consecutive layers])`` turns several layers' partials into their fields at once (the forward pass batches them up
    to a memory budget), for work whose cost is in its number of steps rather than their size (Prim's algorithm)."""

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


def _keys(rows: Rows):
    import torch

    return torch.arange(rows.probs.shape[-1], device=rows.probs.device)


@reducer("lookback", version=2)
def lookback(rows: Rows) -> dict:
    """Lookback ratio of every head at every response step (Lookback Lens, section 2.1): ``ratio [B, H, R]``.

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
    n_prompt, n_ctx = rows.tensor("n_prompt"), context_length(rows)
    on_ctx_key = _keys(rows)[None, :] < n_ctx[:, None]  # [B, K]
    # both sums of every row in one product with [context key, new key] indicator columns: one pass, no copies
    sums = torch.matmul(w, torch.stack([on_ctx_key, ~on_ctx_key], dim=-1).to(w.dtype)[:, None])  # [B, H, R, 2]
    ctx_sum, new_sum = sums[..., 0], sums[..., 1]
    steps = torch.arange(rows.r_max, device=w.device)[None, :]
    queries = n_prompt[:, None] - 1 + steps  # [B, R]
    on_context = torch.where(n_ctx[:, None, None] > 0, ctx_sum / n_ctx.clamp(min=1)[:, None, None].to(w.dtype),
                             torch.zeros_like(ctx_sum))
    on_new = new_sum / (queries - n_ctx[:, None] + 1).to(w.dtype)[:, None, :]
    total = on_context + on_new
    return {"ratio": torch.where(total > 0, on_context / total.clamp_min(1e-30), torch.full_like(total, 0.5))}


def context_length(rows: Rows):
    """``[B]``: the context's length for Lookback Lens, the prompt without the answer header (or its last token)."""
    return rows.tensor("n_prompt") - rows.tensor("n_header").clamp(min=1)


@reducer("diag", version=1)
def diag(rows: Rows) -> dict:
    """Attention of each response token on itself, ``w [B, H, R]`` (the diagonal of LLM-Check's attention score,
    Sriramanan et al. 2024)."""
    return {"w": rows.response_keys(rows.response(), diagonal=True)}


@reducer("sink", version=1)
def sink(rows: Rows) -> dict:
    """Attention of each response token on the first token of the input (the attention sink), ``w [B, H, R]``."""
    return {"w": rows.response()[..., 0]}


@reducer("copy", version=1)
def copy(rows: Rows) -> dict:
    """Copy attention of every head at every response step: ``mass [B, H, R]``, the attention that the query
    generating response token ``y_i`` (the one Lookback Lens reads, :func:`lookback`) puts on the context keys that
    hold the same token as ``y_i``:

        mass_i = sum over k < c with x_k = y_i of w_i[k],   c = n_prompt - max(n_header, 1)

    A head that copies (or an induction head, which attends to the token after an earlier occurrence of the current
    one) puts its mass on the token it is about to emit; a generated token that no head looked up in the context
    has a mass near 0 everywhere, whether or not the token occurs there. halwatch's own alignment signal for the
    token model (issue 33's "attention mass on its best-matching context tokens"), not a published method's.
    O(H R n), no R x R product.
    """
    import torch

    w = rows.steps()
    b, h, r, k = w.shape
    ids = rows.tensor("ids")[:, :k]  # [B, K]
    n_prompt, n_ctx = rows.tensor("n_prompt"), context_length(rows)
    steps = torch.arange(r, device=w.device)[None, :]
    generated = ids.gather(1, (n_prompt[:, None] + steps).clamp(max=ids.shape[1] - 1))  # [B, R]
    on_context = (_keys(rows)[None, :] < n_ctx[:, None])[:, None, :]  # [B, 1, K]
    match = ((ids[:, None, :] == generated[:, :, None]) & on_context).to(w.dtype)  # [B, R, K]
    return {"mass": (w * match[:, None]).sum(-1)}


def _prim(dist, key, blocked, weights: bool = False):
    """Dense Prim's algorithm vectorised over trees (the heads of every sample), grown from a root already in the
    tree: ``dist [T, N, N]`` symmetric distances between the other nodes, ``key [T, N]`` their distances to the
    root, ``blocked [T, N]`` 0 for the nodes of each tree and ``inf`` for padding (a tree with fewer nodes). Returns
    the weight of the edge by which each node joins its tree, ``[T, N]`` (0 for padding). With ``weights``,
    ``dist`` holds symmetric attention weights ``w`` instead (MTop-Div's ``max(w_ij, w_ji)``), whose distances are
    ``1 - w`` (:func:`_distance`): the GPU kernel makes them as it reads each row; elsewhere they are made here.

    Once a tree holds all its nodes, its remaining steps pick a node already in it and write that node's weight
    again: ``key`` no longer changes there, so the result is the same.

    On a GPU with Triton, one launch grows every tree (:mod:`halwatch.signals.prim_kernel`, the same picks); this
    loop is the reference, the CPU path and the fallback."""
    import torch

    done = prim_kernel.KERNEL.attempt(dist, prim_kernel.prim, dist, key, blocked, weights=weights)
    if done is not None:
        return done
    if weights:
        dist = _distance(dist)
    n_trees, n = key.shape
    rows = dist.reshape(n_trees * n, n)  # row j of tree t is row t * n + j: one index_select per step, not the
    first = torch.arange(n_trees, device=key.device) * n  # slower advanced indexing (half the loop's time on a CPU)
    padding = torch.isinf(blocked)
    key = key.clone()
    blocked = blocked.clone()
    edges = torch.zeros_like(key)
    for _ in range(n):  # scatter and gather, not indexed assignment: a number assigned by index is copied to the
        j = torch.argmin(key + blocked, dim=1)  # device with a wait at every step
        at = j[:, None]
        edges.scatter_(1, at, key.gather(1, at))
        blocked.scatter_(1, at, float("inf"))
        torch.minimum(key, rows.index_select(0, first + j).add_(blocked), out=key)
    return edges.masked_fill(padding, 0.0)


def _distance(w):
    return 1.0 - w.clamp(0.0, 1.0)


def _padding(valid, heads: int):
    """``[B, H, N]``: 0 where ``valid [B, N]``, ``inf`` elsewhere (Prim's ``blocked``)."""
    import torch

    inf = torch.full(valid.shape, float("inf"), device=valid.device)
    return torch.where(valid, torch.zeros_like(inf), inf)[:, None, :].expand(-1, heads, -1)


def _mtopdiv_finish(partials: list[dict]) -> dict:
    """Prim's algorithm once for the heads of several layers of every sample (their root and pairwise distances)."""
    import torch

    key, blocked = (torch.cat([p[name] for p in partials], dim=1) for name in ("key", "blocked"))
    b, h, n = key.shape
    trees = key.reshape(b * h, n), blocked.reshape(b * h, n)
    if all("dist" in p for p in partials):  # the torch reducer's distances
        weights = _prim(torch.cat([p["dist"] for p in partials], dim=1).reshape(b * h, n, n), *trees)
    else:  # the GPU kernel's weights (with the torch reducer's distances of layers it left to it)
        block = torch.cat([p["block"] if "block" in p else 1.0 - p["dist"] for p in partials], dim=1)
        weights = _prim(block.reshape(b * h, n, n), *trees, weights=True)
    weights = weights.reshape(b, h, n)
    size = torch.isfinite(blocked).sum(-1).clamp(min=1).to(weights.dtype)
    return {"d": weights.sum(-1) / size, "token_weights": weights}


@reducer("mtopdiv", version=1, finish=_mtopdiv_finish)
def mtopdiv(rows: Rows) -> dict:
    """MTop-Div_G(R, P) of every head (TOHA, Prop. 3.1 and eq. 3): the weight of the minimum spanning forest that
    attaches the response tokens to the prompt, with the prompt contracted to one root (distance ``1 - max_p w_rp``,
    since a prompt token never attends to a response token) and response-response distances ``1 - max(w_ab,
    w_ba)``. ``d [B, H]`` = MTop-Div / |R| and ``token_weights [B, H, R]``, the forest edge by which each response
    token is attached. See :func:`halwatch.signals.topology.mtopdiv` (the NumPy reference). Per layer only the
    distances are computed (the GPU kernel's path keeps the symmetric weights ``max(w_ab, w_ba)`` instead, and Prim's
    kernel makes the distances as it reads them); Prim's algorithm runs on the heads of several layers of all samples
    at once (:func:`_mtopdiv_finish`).
    """
    w = rows.response()
    on_prompt = (_keys(rows)[None, :] < rows.tensor("n_prompt")[:, None])[:, None, None, :]
    block = rows.response_keys(w)
    return {"key": _distance((w * on_prompt).amax(-1)), "dist": _distance(block.maximum(block.transpose(2, 3))),
            "blocked": rows.padding(w.shape[1])}


@reducer("mst", version=1, needs_all_rows=True)
def mst(rows: Rows) -> dict:
    """Length of the minimum spanning tree of the complete attention graph (prompt-prompt distances kept), over
    |R|: TOHA's ablation (section 4.4, Table 4), ``d [B, H]``. Needs the rows of every token."""
    import torch

    if any(rows.row_start):
        raise ValueError("the 'mst' reducer needs attention rows of every token (attention_from='all')")
    w = rows.probs
    b, h, q, k = w.shape
    n = min(q, k)
    if n == 1:
        return {"d": w.new_zeros(b, h)}
    sym = w[:, :, :n, :n].maximum(w[:, :, :n, :n].transpose(2, 3))
    valid = torch.arange(n - 1, device=w.device)[None, :] < (rows.tensor("length") - 1)[:, None]  # nodes 1 .. n-1
    weights = _prim(_distance(sym[:, :, 1:, 1:]).reshape(b * h, n - 1, n - 1),
                    _distance(sym[:, :, 0, 1:]).reshape(b * h, n - 1),
                    _padding(valid, h).reshape(b * h, n - 1)).reshape(b, h, n - 1)
    return {"d": weights.sum(-1) / rows.tensor("n_response")[:, None].to(weights.dtype)}


#: The reducers that :func:`from_statistics` serves from the GPU kernel's per-row statistics.
FROM_STATISTICS = ("lookback", "diag", "sink", "mtopdiv")


def from_statistics(rows: Rows, stats: dict, names) -> dict:
    """Each named reducer's fields (what its function returns, or MTop-Div's partial) from the per-row statistics
    of :func:`halwatch.signals.rows_kernel.rows` for the layout of ``rows`` (whose ``probs`` are never made)."""
    out = {}
    for name in names:
        if name == "lookback":
            out[name] = {"ratio": stats["ratio"]}
        elif name in ("diag", "sink"):
            out[name] = {"w": stats[name]}
        elif name == "mtopdiv":
            out[name] = {"key": stats["root"], "block": stats["block"],
                         "blocked": rows.padding(stats["block"].shape[1])}
        else:
            raise ValueError(f"reducer {name!r} needs the attention rows themselves")
    return out
