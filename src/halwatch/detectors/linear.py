"""Logistic regression for large feature matrices (hundreds of thousands of tokens x a few thousand features):
full-batch L-BFGS in torch, float32, L2 penalty chosen by grouped cross-validation. scikit-learn's solvers copy
such a matrix to float64 (gigabytes); this one works on it in place. Models are JSON-ready dicts (packed arrays),
scored by :func:`logodds` with NumPy alone."""

from __future__ import annotations

import numpy as np

from halwatch.detectors.classifiers import pack, unpack

#: The L2 strengths (per sample, on standardised features) that ``l2="cv"`` chooses from.
L2_GRID = (1e-2, 1e-1, 1.0)


def _train(x, y, weight, l2: float, iterations: int):
    import torch

    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=iterations, history_size=20, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-6, tolerance_change=1e-9)
    loss_fn = torch.nn.BCEWithLogitsLoss(weight=weight)

    def closure():
        opt.zero_grad()
        loss = loss_fn(x @ w + b, y) + 0.5 * l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), float(b.detach())


def fit(x, labels, l2: float | str = "cv", groups=None, folds: int = 3, iterations: int = 200,
        balance: bool = False, seed: int = 0, weights=None) -> dict:
    """A logistic regression on standardised ``x`` (``[n, d]``, float32 kept). ``l2="cv"``: the strength from
    :data:`L2_GRID` with the best held-out log-loss over ``folds`` folds (by ``groups`` when given, e.g. the answer
    of each token, so that a group is never split). ``balance``: weight the classes equally; ``weights``: a weight
    per row instead (e.g. the inverse of the rate at which a subsampled class was kept)."""
    import torch

    x = torch.as_tensor(np.ascontiguousarray(x, dtype=np.float32))
    y = torch.as_tensor(np.asarray(labels, dtype=np.float32))
    mean = x.mean(0)
    std = x.std(0).clamp_min(1e-6)
    z = (x - mean) / std
    pos = float(y.mean())
    weight = torch.where(y > 0, 0.5 / max(pos, 1e-6), 0.5 / max(1 - pos, 1e-6)) if balance else None
    if weights is not None:
        weight = torch.as_tensor(np.asarray(weights, dtype=np.float32))
    chosen = l2
    if l2 == "cv":
        from sklearn.model_selection import GroupKFold, StratifiedKFold

        idx = np.arange(len(y))
        split = (GroupKFold(folds).split(idx, groups=groups) if groups is not None
                 else StratifiedKFold(folds, shuffle=True, random_state=seed).split(idx, labels))
        splits = list(split)
        losses = []
        for value in L2_GRID:
            total = 0.0
            for train, held in splits:
                w, b = _train(z[train], y[train], None if weight is None else weight[train], value, iterations)
                total += float(torch.nn.functional.binary_cross_entropy_with_logits(
                    z[held] @ w + b, y[held], weight=None if weight is None else weight[held], reduction="sum"))
            losses.append(total)
        chosen = L2_GRID[int(np.argmin(losses))]
    w, b = _train(z, y, weight, float(chosen), iterations)
    return {"mean": pack(mean.numpy()), "std": pack(std.numpy()), "coef": pack(w.numpy()), "intercept": b,
            "l2": float(chosen)}


def logodds(model: dict, x) -> np.ndarray:
    z = (np.asarray(x, dtype=np.float32) - unpack(model["mean"])) / unpack(model["std"])
    return z @ unpack(model["coef"]) + model["intercept"]
