"""The attention mask of a layer applied to recomputed attention scores (the capture of the forward pass and the
explicit attention of the relevance pass both recompute scores from a layer's query and key states)."""

from __future__ import annotations


def masked_scores(scores, mask, first_row: int):
    """Attention scores ``[..., Q, K]`` with the layer's mask applied: ``mask`` cut to these rows and columns
    (boolean = allowed, else additive), or ``None`` for the causal mask of queries at positions ``first_row ...``."""
    import torch

    if mask is None:
        rows = torch.arange(first_row, first_row + scores.shape[-2], device=scores.device)[:, None]
        cols = torch.arange(scores.shape[-1], device=scores.device)[None, :]
        return scores.masked_fill(cols > rows, float("-inf"))
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask.to(scores.dtype)
