"""Prim's algorithm for many small dense trees in one GPU launch (Triton), for MTop-Div (TOHA, Prop. 3.1 and eq. 3).

:func:`halwatch.signals.reducers._prim` grows every tree of a batch in lockstep with torch: one step adds one node to
each tree, and a step is several kernel launches over all trees (argmin, gather, two scatters, a row gather and a
minimum). With the 270 heads of every answer of a batch that is a few thousand launches per batch, each doing a few
microseconds of work: on an H100 Prim's algorithm took about a third of the capture's GPU time (1.35 ms per
RAGTruth answer of 4.4 ms, and 14,000 launches per 256 answers).

Here one Triton program grows one tree from start to end: its distances to the tree stay in registers, each step is
an argmin over them and one coalesced load of the chosen node's row of distances, and a tree stops after its own
number of nodes instead of the longest tree's. The result is the same as the torch loop's (the same node is picked
at each step: the first of equal minima), which stays the reference, the CPU path and the fallback where Triton is
missing or cannot compile for the device.
"""

from __future__ import annotations

from halwatch.signals.triton_kernels import Kernel, launching_on


def _make():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n"])  # no recompilation for each size's divisibility by 16
    def prim_kernel(dist_ptr, key_ptr, blocked_ptr, out_ptr, n, WEIGHTS: tl.constexpr, BLOCK: tl.constexpr):
        tree = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        inside = offs < n
        key = tl.load(key_ptr + tree * n + offs, mask=inside, other=float("inf"))
        blocked = tl.load(blocked_ptr + tree * n + offs, mask=inside, other=float("inf"))
        weights = tl.zeros([BLOCK], dtype=tl.float32)
        nodes = tl.sum((blocked == 0.0).to(tl.int32), axis=0)
        for _ in range(nodes):
            candidate = key + blocked
            best = tl.min(candidate, axis=0)
            j = tl.argmin(candidate, axis=0, tie_break_left=True)
            chosen = offs == j
            weights = tl.where(chosen, best, weights)
            blocked = tl.where(chosen, float("inf"), blocked)
            row = tl.load(dist_ptr + (tree * n + j) * n + offs, mask=inside, other=0.0)
            if WEIGHTS:  # symmetric attention weights: the distance is 1 - w, clipped to [0, 1]
                row = 1.0 - tl.minimum(tl.maximum(row, 0.0), 1.0)
            key = tl.minimum(key, row + blocked)
        tl.store(out_ptr + tree * n + offs, weights, mask=inside)

    return prim_kernel


KERNEL = Kernel(_make, "Prim's algorithm falls back to the torch loop")


def prim(dist, key, blocked, weights: bool = False):
    """The contract of :func:`halwatch.signals.reducers._prim` (``dist [T, N, N]``, ``key [T, N]``, ``blocked
    [T, N]``: 0 for a tree's nodes, ``inf`` for padding; returns each node's joining edge ``[T, N]``, 0 for
    padding), one program per tree. With ``weights``, ``dist`` holds symmetric attention weights ``w`` (MTop-Div's
    ``max(w_ij, w_ji)``) and the distance of nodes ``i, j`` is ``1 - w_ij`` clipped to ``[0, 1]``, made as each row
    is read (two passes over ``[T, N, N]`` fewer). Each step reads one row, contiguous: reading a column as well (to
    symmetrise here) made the kernel bound by its scattered loads, its time growing as ``N^2`` whatever the launch
    width (an H100, 12,960 trees: 2.5 ms at 96 nodes, 42 ms at 320). Raises where Triton cannot run here (the
    caller falls back)."""
    import torch

    run = KERNEL.get()
    if run is None:
        raise RuntimeError("Triton is not installed")
    n_trees, n = key.shape
    out = torch.zeros(n_trees, n, dtype=torch.float32, device=key.device)
    if n_trees == 0 or n == 0:
        return out
    import triton

    block = max(16, triton.next_power_of_2(n))
    with launching_on(key.device):
        run[(n_trees,)](dist.float().contiguous(), key.float().contiguous(), blocked.float().contiguous(), out, n,
                        WEIGHTS=weights, BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return out.to(key.dtype)
