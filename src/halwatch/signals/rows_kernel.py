"""The attention rows of a layer and their per-head reductions in one GPU launch (Triton), never written out.

The capture (:mod:`halwatch.models.forward`) recomputes the attention rows of the queries it reads, ``softmax(Q K^T
* scaling + mask)`` in float32, as ``[B, H, Q, K]`` tensors, and the reducers (:mod:`halwatch.signals.reducers`) then
read them: a dozen passes over that tensor and about 200 kernel launches per layer. On an H100 that was most of the
capture's GPU time (the scores' product, mask, softmax, the float copies, the masked maximum of MTop-Div's root
distance) and most of the host's launches.

Here one program computes ``BLOCK_Q`` rows of one head of one sample, like an attention kernel that keeps
statistics of the weights instead of multiplying them with the values: a first pass over the keys finds each row's
maximum and normaliser (the online softmax), a second recomputes each weight and adds it where it belongs. Row ``r``
of sample ``b`` is the query at position ``n_prompt - 1 + r``, ``r = 0 .. R`` (``R`` response tokens), so that
row ``r`` is Lookback Lens's step ``r`` (the query that generates response token ``r``) and, for ``r >= 1``, the row
of response token ``r - 1`` itself (TOHA, the diagonal and the sink read those). Per row it keeps:

- the weight on the context keys (``k < n_ctx``) and on the others, turned into Lookback Lens's ratio (steps
  ``r < R``; section 2.1, as :func:`halwatch.signals.reducers.lookback` computes it);
- the largest weight on a prompt key (``k < n_prompt``), whose complement is MTop-Div's root distance;
- ``diag``, ``sink``: the weight on the query's own key and on the first key;
- ``block[r - 1, j]`` and ``block[j, r - 1]``: the weight on response key ``n_prompt + j``, ``j <= r - 1``
  (MTop-Div's response graph, symmetric: a token never attends to a later one, so ``max(w_ij, w_ji)`` is the weight
  of the one that looks back).

The mask is the causal one of a right-padded batch (key ``k`` is seen by the query at ``p`` iff ``k <= p`` and
``k`` is a real token), which the capture checks against the layer's own mask before it takes this path; soft-capped
logits, sliding windows, a cached prefix or rows kept for the user take the torch path, which stays the reference
(``tests/test_kernels.py`` compares the two).
"""

from __future__ import annotations

from halwatch.signals.triton_kernels import Kernel, launching_on

#: Rows and keys of one program's tile.
BLOCK_Q = 32
BLOCK_K = 64


def _make():
    import triton
    import triton.language as tl

    # the batch's sizes vary from call to call: no recompilation for each one's divisibility by 16
    @triton.jit(do_not_specialize=["sq_b", "sk_b", "r_max"])
    def rows_kernel(q_ptr, k_ptr, heads_ptr, n_prompt_ptr, n_ctx_ptr, length_ptr,
                    ratio_ptr, root_ptr, diag_ptr, sink_ptr, block_ptr,
                    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d,
                    n_heads, group, r_max, scale, d_head,
                    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
        bh = tl.program_id(0).to(tl.int64)
        b = bh // n_heads
        head = tl.load(heads_ptr + bh % n_heads)  # the model's query head
        kv = head // group  # the key head it reads (grouped-query attention)
        n_prompt = tl.load(n_prompt_ptr + b)
        n_ctx = tl.load(n_ctx_ptr + b)
        length = tl.load(length_ptr + b)
        n_resp = length - n_prompt
        r = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        row_ok = r <= n_resp
        pos = tl.minimum(n_prompt - 1 + r, length - 1)
        d = tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + b * sq_b + head * sq_h + pos[:, None] * sq_t + d[None, :] * sq_d,
                    mask=row_ok[:, None] & (d[None, :] < d_head), other=0.0)
        k_end = tl.max(tl.where(row_ok, pos, 0), axis=0) + 1
        k_base = k_ptr + b * sk_b + kv * sk_h
        m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        norm = tl.zeros([BLOCK_Q], dtype=tl.float32)
        ctx = tl.zeros([BLOCK_Q], dtype=tl.float32)
        new = tl.zeros([BLOCK_Q], dtype=tl.float32)
        prompt_max = tl.zeros([BLOCK_Q], dtype=tl.float32)
        diag = tl.zeros([BLOCK_Q], dtype=tl.float32)
        sink = tl.zeros([BLOCK_Q], dtype=tl.float32)
        response_row = row_ok & (r >= 1)
        token = r - 1  # the response token whose own row this is
        # pass 0: each row's maximum and normaliser (the online softmax); pass 1: the weights, where they belong
        for second in tl.static_range(2):
            for k0 in range(0, k_end, BLOCK_K):
                keys = k0 + tl.arange(0, BLOCK_K)
                kt = tl.load(k_base + keys[None, :] * sk_t + d[:, None] * sk_d,
                             mask=(keys[None, :] < length) & (d[:, None] < d_head), other=0.0)
                if IEEE:
                    s = tl.dot(q, kt, input_precision="ieee") * scale
                else:
                    s = tl.dot(q, kt) * scale
                seen = keys[None, :] <= pos[:, None]
                s = tl.where(seen, s, float("-inf"))
                if second == 0:
                    m_new = tl.maximum(m, tl.max(s, axis=1))
                    norm = norm * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
                    m = m_new
                else:
                    p = tl.exp(s - m[:, None]) / norm[:, None]
                    on_ctx = keys[None, :] < n_ctx
                    ctx += tl.sum(tl.where(on_ctx, p, 0.0), axis=1)
                    new += tl.sum(tl.where(on_ctx, 0.0, p), axis=1)
                    prompt_max = tl.maximum(prompt_max, tl.max(tl.where(keys[None, :] < n_prompt, p, 0.0), axis=1))
                    diag += tl.sum(tl.where(keys[None, :] == pos[:, None], p, 0.0), axis=1)
                    sink += tl.sum(tl.where(keys[None, :] == 0, p, 0.0), axis=1)
                    j = keys[None, :] - n_prompt
                    response_key = response_row[:, None] & (j >= 0) & (j < n_resp) & seen  # j <= token
                    tl.store(block_ptr + (bh * r_max + token[:, None]) * r_max + j, p, mask=response_key)
                    # and its mirror: a token never sees a later one, so max(w_ij, w_ji) is the weight that looks back
                    tl.store(block_ptr + (bh * r_max + j) * r_max + token[:, None], p, mask=response_key)
        # Lookback Lens's ratio at step r (reducers.lookback): the mean weight on the context against the mean weight
        # on the new tokens up to the query
        on_context = tl.where(n_ctx > 0, ctx / tl.maximum(n_ctx, 1).to(tl.float32), 0.0)
        on_new = new / (pos - n_ctx + 1).to(tl.float32)
        total = on_context + on_new
        ratio = tl.where(total > 0, on_context / tl.maximum(total, 1e-30), 0.5)
        out = bh * r_max
        tl.store(ratio_ptr + out + r, ratio, mask=row_ok & (r < n_resp))
        tl.store(root_ptr + out + token, 1.0 - tl.minimum(tl.maximum(prompt_max, 0.0), 1.0), mask=response_row)
        tl.store(diag_ptr + out + token, diag, mask=response_row)
        tl.store(sink_ptr + out + token, sink, mask=response_row)

    return rows_kernel


KERNEL = Kernel(_make, "the capture falls back to attention rows in torch")


def rows(query, key, heads, n_prompt, n_ctx, length, r_max: int, scaling: float) -> dict:
    """The statistics of the module docstring for the ``heads`` (a ``[H]`` int32 tensor of query heads) of every
    sample: ``query [B, Hq, T, D]`` and ``key [B, KV, T, D]`` as the layer made them (any strides), ``n_prompt``,
    ``n_ctx``, ``length`` ``[B]`` int32 tensors on the same device. Returns, float32 and zero where a sample has no
    such row: ``ratio`` (Lookback Lens's, from ``ctx`` and ``new``), ``root`` (MTop-Div's root distance, ``1 -
    prompt_max`` clipped), ``diag``, ``sink`` ``[B, H, r_max]`` and ``block [B, H, r_max, r_max]`` (symmetric).
    Raises where Triton cannot run here (the caller falls back)."""
    import torch
    import triton

    run = KERNEL.get()
    if run is None:
        raise RuntimeError("Triton is not installed")
    b, n_heads = query.shape[0], heads.shape[0]
    dev = query.device
    fields = ("ratio", "root", "diag", "sink")
    out = dict(zip(fields, torch.zeros(len(fields), b, n_heads, r_max, dtype=torch.float32, device=dev)))
    out["block"] = torch.zeros(b, n_heads, r_max, r_max, dtype=torch.float32, device=dev)
    if key.dtype != query.dtype:
        key = key.to(query.dtype)
    grid = (b * n_heads, triton.cdiv(r_max + 1, BLOCK_Q))
    d_head = query.shape[-1]
    with launching_on(dev):
        run[grid](query, key, heads, n_prompt, n_ctx, length,
                  out["ratio"], out["root"], out["diag"], out["sink"], out["block"],
                  *query.stride(), *key.stride(), n_heads, query.shape[1] // key.shape[1], r_max, float(scaling),
                  d_head, BLOCK_Q=BLOCK_Q, BLOCK_K=BLOCK_K, BLOCK_D=max(16, triton.next_power_of_2(d_head)),
                  IEEE=query.dtype == torch.float32, num_warps=4)
    return out
