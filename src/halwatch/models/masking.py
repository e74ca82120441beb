"""The attention mask of a layer applied to recomputed attention scores (the capture of the forward pass and the
explicit attention of the relevance pass both recompute scores from a layer's query and key states), and attention
spelt out as explicit products where no fused kernel serves."""

from __future__ import annotations


def masked_scores(scores, mask, first_row):
    """Attention scores ``[..., Q, K]`` with the layer's mask applied: ``mask`` cut to these rows and columns
    (boolean = allowed, else additive), or ``None`` for the causal mask of queries at positions ``first_row ...``
    (an int), or at the positions ``first_row`` holds (a tensor ``[..., Q, 1]``)."""
    import torch

    if mask is None:
        rows = first_row if torch.is_tensor(first_row) else torch.arange(
            first_row, first_row + scores.shape[-2], device=scores.device)[:, None]
        cols = torch.arange(scores.shape[-1], device=scores.device)[None, :]
        return scores.masked_fill(cols > rows, float("-inf"))
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask.to(scores.dtype)


def capped(scores, softcap):
    """Gemma 2's attention-logit soft-capping, ``softcap * tanh(scores / softcap)``; ``scores`` as they are without."""
    import torch

    return scores if not softcap else torch.tanh(scores / softcap) * softcap


def attention_probs(scores, scaling, softcap, mask, first_row):
    """The attention weights of raw ``Q K^T`` products: scaled, soft-capped where the model caps (:func:`capped`),
    masked (:func:`masked_scores`) and normalised. What every capture of attention rows recomputes."""
    import torch

    scores = scores if scaling == 1 else scores * scaling
    return torch.softmax(masked_scores(capped(scores, softcap), mask, first_row), dim=-1)


def explicit_attention(query, key, value, attention_mask, scaling=None, softcap=None):
    """``softmax(cap(Q K^T * scaling) + mask) V`` as explicit products (``[B, H, T, D]`` inputs, grouped keys and
    values repeated), in the ``[B, T, H, D]`` output layout of transformers' attention functions. No mask: the
    causal one, the queries being the last positions of the keys."""
    import torch

    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scores = capped(torch.matmul(query, key.transpose(-1, -2)) * scaling, softcap)
    n_q, n_k = scores.shape[-2:]
    scores = masked_scores(scores, None if attention_mask is None else attention_mask[..., :n_k], n_k - n_q)
    # a padding query of a batch may see no key at all (a sliding window that ends before its answer does): its row
    # is zero, not the NaN of a softmax over nothing, which would reach the real rows through 0 * NaN
    dead = torch.isneginf(scores).all(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(dead, 0.0).float(), dim=-1).masked_fill(dead, 0.0).to(value.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()
