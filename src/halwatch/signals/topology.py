"""Topological divergence of attention graphs (TOHA, Bazarova et al.): MTop-Div_G(R, P) and the MST-length ablation.

References are to ``shared/papers/toha.md`` ("Hallucination Detection in LLMs with Topological Divergence on Attention
Graphs").

Attention graph (Sec. 2.1, 3.1).  For one head, the attention map ``w`` (lower triangular, row ``i`` = query ``i``)
defines a complete undirected graph on the ``n`` tokens with pseudo-distance ``1 - max(w_ij, w_ji)`` between tokens
``i`` and ``j``.  The tokens split into the prompt ``P`` (positions ``0..n_prompt-1``) and the response ``R``
(positions ``n_prompt..n-1``).

MTop-Div_G(R, P) (Sec. 3.1).  Set the distances between prompt tokens to zero, take the 0-th barcode of the
Vietoris-Rips filtration of the modified graph and sum the bar lengths.  By Proposition 3.1 (proof in App. C) this
equals the weight of the minimum spanning forest (MSF) attaching ``R`` to ``P``.  Since all prompt tokens are at
distance 0 from each other, that forest is exactly a minimum spanning tree of the graph in which ``P`` is contracted
to one root node, with distance ``min_p (1 - max(w_rp, w_pr))`` from response token ``r`` to the root.  That tree has
exactly ``|R|`` edges (one per response token: the edge by which the token is attached when Prim's algorithm is
grown from the root), so it is computed here with a dense Prim's algorithm on ``|R| + 1`` nodes, vectorised over
heads: ``O(H * R * n_prompt)`` to build the root distances plus ``O(H * R^2)`` for Prim; heads are processed in
chunks so that the float64 ``R x R`` distance blocks take about 16 MiB at a time.

No topology library is needed at run time (``ripser`` is only the cross-check in the tests).  Note that
``scipy.sparse.csgraph.minimum_spanning_tree`` would be wrong here: it reads zero entries (the zeroed prompt block,
and distance 0 where an attention weight is 1) as missing edges.

Properties (Proposition C.1): ``0 <= MTop-Div <= |R|`` (eq. 4), because every distance lies in ``[0, 1]`` and the
forest has ``|R|`` edges; if every attention weight changes by at most ``eps``, every distance changes by at most
``eps`` (``max`` and clipping to ``[0, 1]`` are 1-Lipschitz) and MTop-Div changes by at most ``eps * |R|``
(stability).  The per-head score used to rank heads and by TOHA is the normalised ``d = MTop-Div / |R|`` (eq. 3).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["MTopDivResult", "MSTLengthResult", "mtopdiv", "mst_length"]


class MTopDivResult(NamedTuple):
    """MTop-Div_G(R, P) of every head of one sample (float64 arrays).

    ``total``: shape ``[H]``, MTop-Div_G(R, P) = weight of the MSF attaching R to P (Prop. 3.1), in ``[0, |R|]``.
    ``d``: shape ``[H]``, ``total / |R|`` (the normalised divergence ``d_ij(s)`` of eq. 3), in ``[0, 1]``.
    ``token_weights``: shape ``[H, R]``, for each response token the length (``1 - attention weight``) of the forest
    edge by which it is attached (its edge towards the prompt side of the tree); in ``[0, 1]``, sums to ``total``.
    ``parent``: shape ``[H, R]`` int64, absolute position (``0..n-1``) of the token at the other end of that edge: a
    prompt position (the prompt token it attends to most) when the token hangs directly on the prompt, otherwise the
    position of another response token.
    """

    total: np.ndarray
    d: np.ndarray
    token_weights: np.ndarray
    parent: np.ndarray


class MSTLengthResult(NamedTuple):
    """Length of the minimum spanning tree of the complete attention graph (ablation of Sec. 4.4, Table 4).

    ``total``: shape ``[H]``, MST weight (``n - 1`` edges, distances ``1 - max(w_ij, w_ji)``, prompt block kept).
    ``d``: shape ``[H]``, ``total / |R|`` with ``|R| = n - n_prompt`` when ``n_prompt`` was given (the same
    normalisation as ``d`` of eq. 3, so the ablation can replace MTop-Div in Algorithm 1 one for one); ``None`` when
    ``n_prompt`` was not given.
    """

    total: np.ndarray
    d: np.ndarray | None


def _as_float_array(x, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiub":
        raise ValueError(f"{name}: expected a real numeric array, got dtype {arr.dtype}")
    if arr.dtype.kind != "f":
        arr = arr.astype(np.float64)
    # Fast path: a finite sum proves every entry finite; only when it is not (NaN/inf, or a float16 overflow of the
    # sum itself) look at every entry.
    if not np.isfinite(arr.sum()) and not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: contains NaN or infinite values")
    return arr


def _dist(weights: np.ndarray) -> np.ndarray:
    """``1 - w`` in float64 after clipping ``w`` to ``[0, 1]`` (attention rows may stray by float error)."""
    out = np.clip(weights, 0.0, 1.0).astype(np.float64, copy=False)  # clip returns a fresh array
    np.subtract(1.0, out, out=out)
    return out


# Heads are processed in chunks whose symmetric distance block (float64) takes about this many bytes: small enough to
# stay in cache during Prim's loop (measured fastest around 8-16 MiB), large enough to vectorise over heads.
_CHUNK_BYTES = 16 << 20


def _prim(dist: np.ndarray, key: np.ndarray, parent: np.ndarray, parent_offset: int):
    """Dense Prim's algorithm, vectorised over heads, for a tree grown from a root that is already in the tree.

    ``dist[h]``: symmetric ``[N, N]`` float64 distances between the ``N`` non-root nodes (diagonal ignored).
    ``key[h, v]``: distance from node ``v`` to the root; ``parent[h, v]``: the label of the root end of that edge.
    Returns ``(weights [H, N], parent [H, N])``: the weight of the edge by which each node joined the tree and the
    label of its other endpoint (a non-root node ``u`` is labelled ``parent_offset + u``).  ``O(H * N^2)``.
    """
    n_heads, n_nodes = key.shape
    heads = np.arange(n_heads)
    key = key.astype(np.float64, copy=True)
    parent = parent.copy()
    weights = np.empty((n_heads, n_nodes), dtype=np.float64)
    # ``blocked`` is +inf on nodes already in the tree, 0 elsewhere: adding it keeps them out of argmin and updates.
    blocked = np.zeros((n_heads, n_nodes), dtype=np.float64)
    for _ in range(n_nodes):
        j = np.argmin(key + blocked, axis=1)
        weights[heads, j] = key[heads, j]
        blocked[heads, j] = np.inf
        cand = dist[heads, j] + blocked
        better = cand < key
        np.copyto(key, cand, where=better)
        np.copyto(parent, (parent_offset + j)[:, None], where=better)
    return weights, parent


def _head_chunks(n_heads: int, n_nodes: int):
    step = max(1, _CHUNK_BYTES // max(1, n_nodes * n_nodes * 8))
    for start in range(0, n_heads, step):
        yield slice(start, min(start + step, n_heads))


def _sym_dist(block: np.ndarray) -> np.ndarray:
    """``1 - max(w_ab, w_ba)`` for a stack of square blocks ``[h, N, N]``, float64."""
    return _dist(np.maximum(block, block.transpose(0, 2, 1)))


def mtopdiv(rows, n_prompt: int) -> MTopDivResult:
    """MTop-Div_G(R, P) (Sec. 3.1, eq. 3, Prop. 3.1) for ``H`` heads of one sample.

    ``rows``: array ``[H, R, n]``, ``n = n_prompt + R``: the attention rows of the ``R`` response tokens (query
    positions ``n_prompt..n-1``) over all ``n`` key positions, for ``H`` heads (float16/32/64; numpy, or anything
    ``np.asarray`` accepts, e.g. a CPU torch tensor).  Causal attention is assumed only for the prompt rows, which are
    not given: a prompt token is taken to put zero weight on every response token (``w_pr = 0``).  Within the
    response block the graph uses ``max(w_rr', w_r'r)`` as given.  Weights are clipped to ``[0, 1]``.

    Returns :class:`MTopDivResult` (``total``, ``d = total / R``, ``token_weights``, ``parent``), float64.

    Raises ``ValueError`` when ``rows`` is not 3-D, ``n != n_prompt + R``, ``R == 0``, values are not finite, or
    ``n_prompt == 0``: MTop-Div(R, P) attaches R to a non-empty P; with no prompt there is no root for the forest
    (the H0 barcode would just be the MST of R, a different quantity, available from :func:`mst_length`).
    """
    w = _as_float_array(rows, "rows")
    if w.ndim != 3:
        raise ValueError(f"rows: expected shape [H, R, n], got {w.shape}")
    n_heads, n_resp, n = w.shape
    n_prompt = int(n_prompt)
    if n_resp == 0:
        raise ValueError("rows: no response tokens (R = 0); MTop-Div(R, P) is undefined")
    if n_prompt <= 0:
        raise ValueError(
            f"n_prompt must be >= 1, got {n_prompt}: MTop-Div(R, P) measures how R attaches to a non-empty prompt P"
        )
    if n != n_prompt + n_resp:
        raise ValueError(f"rows: last axis {n} != n_prompt + R = {n_prompt} + {n_resp}")
    if n_heads == 0:
        empty = np.zeros((0,), dtype=np.float64)
        return MTopDivResult(empty, empty.copy(), np.zeros((0, n_resp)), np.zeros((0, n_resp), dtype=np.int64))

    # Root (contracted prompt) distances: min_p (1 - max(w_rp, w_pr)) = 1 - max_p w_rp since w_pr = 0.
    prompt_part = w[:, :, :n_prompt]
    best_p = np.argmax(prompt_part, axis=2)
    key0 = _dist(np.take_along_axis(prompt_part, best_p[:, :, None], axis=2)[:, :, 0])
    best_p = best_p.astype(np.int64)

    token_weights = np.empty((n_heads, n_resp), dtype=np.float64)
    parent = np.empty((n_heads, n_resp), dtype=np.int64)
    for hs in _head_chunks(n_heads, n_resp):
        # resp[h, a, b] = weight of response token a on response token b; distances 1 - max(w_ab, w_ba).
        dist = _sym_dist(w[hs, :, n_prompt:])
        token_weights[hs], parent[hs] = _prim(dist, key0[hs], best_p[hs], parent_offset=n_prompt)
    total = token_weights.sum(axis=1)
    return MTopDivResult(total=total, d=total / n_resp, token_weights=token_weights, parent=parent)


def mst_length(full_attention, n_prompt: int | None = None) -> MSTLengthResult:
    """MST length of the complete attention graph: the ablation of Sec. 4.4 / Table 4.

    ``full_attention``: array ``[H, n, n]`` (full attention maps, lower triangular for a decoder).  The distance
    between tokens ``i != j`` is ``1 - max(w_ij, w_ji)`` (weights clipped to ``[0, 1]``) on the complete graph; unlike
    :func:`mtopdiv` nothing is zeroed.  Dense Prim's algorithm, vectorised over heads, ``O(H * n^2)``.

    Returns :class:`MSTLengthResult`: ``total`` (MST weight per head, in ``[0, n - 1]``) and ``d = total / |R|`` with
    ``|R| = n - n_prompt`` if ``n_prompt`` is given (must satisfy ``0 <= n_prompt < n``), else ``d = None``.
    A single token (``n == 1``) has an MST of length 0.
    """
    w = _as_float_array(full_attention, "full_attention")
    if w.ndim != 3 or w.shape[1] != w.shape[2]:
        raise ValueError(f"full_attention: expected shape [H, n, n], got {w.shape}")
    n_heads, n, _ = w.shape
    if n == 0:
        raise ValueError("full_attention: no tokens (n = 0)")
    n_resp = None
    if n_prompt is not None:
        n_prompt = int(n_prompt)
        if not 0 <= n_prompt < n:
            raise ValueError(f"n_prompt must satisfy 0 <= n_prompt < n = {n}, got {n_prompt}")
        n_resp = n - n_prompt
    if n_heads == 0 or n == 1:
        total = np.zeros((n_heads,), dtype=np.float64)
    else:
        # Grow from token 0 (the root): key = its distances to tokens 1..n-1; the other nodes are tokens 1..n-1.
        key0 = _dist(np.maximum(w[:, 0, 1:], w[:, 1:, 0]))
        no_parent = np.zeros((n_heads, n - 1), dtype=np.int64)
        weights = np.empty((n_heads, n - 1), dtype=np.float64)
        for hs in _head_chunks(n_heads, n - 1):
            weights[hs], _ = _prim(_sym_dist(w[hs, 1:, 1:]), key0[hs], no_parent[hs], parent_offset=1)
        total = weights.sum(axis=1)
    return MSTLengthResult(total=total, d=None if n_resp is None else total / n_resp)
