"""halwatch's one logistic regression: every linear model of every detector (family models, stackers, token and
window classifiers, probes) and Platt's calibration are fitted here.

Full-batch L-BFGS (SciPy's, on products computed in torch) on standardised features, float64 for small problems
and float32 for large ones such as hundreds of thousands of tokens x a thousand features, where scikit-learn's
solvers would copy the matrix to float64 (gigabytes). The objective is scikit-learn's:
``sum_i w_i * logloss_i + ||coef||^2 / (2 C)`` (the intercept is not penalised), so ``C`` means what it means there.
``C="cv"`` chooses it from a grid by held-out log-loss over folds that never part a group (a source document, an
answer). Models are JSON-ready dicts, scored by :func:`logodds` with NumPy alone.
"""

from __future__ import annotations

import numpy as np

from halwatch.detectors.classifiers import pack, unpack

#: The inverse regularisation strengths that ``C="cv"`` chooses from by default.
C_GRID = tuple(float(c) for c in np.logspace(-4, 2, 7))
#: Above this many matrix entries the fit runs in float32.
FLOAT64_ENTRIES = 2e7


def folds_of(labels, folds: int, groups=None, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``[(train, held)]``: stratified, shuffled folds, as many as the smaller class (and the number of groups)
    allows and at most ``folds``; with ``groups``, a group is never split between folds."""
    from sklearn.model_selection import StratifiedGroupKFold, StratifiedKFold

    labels = np.asarray(labels, dtype=int)
    k = max(2, min(folds, int(np.bincount(labels, minlength=2).min())))
    idx = np.zeros(len(labels))
    if groups is None:
        return list(StratifiedKFold(k, shuffle=True, random_state=seed).split(idx, labels))
    groups = np.asarray(groups)
    k = max(2, min(k, len(np.unique(groups))))
    return list(StratifiedGroupKFold(k, shuffle=True, random_state=seed).split(idx, labels, groups))


def _log_loss(logits, y, weight):
    """``sum_i w_i * logloss_i`` for (soft) targets ``y``: torch's fused version costs far more on small vectors."""
    import torch

    return (weight * (torch.nn.functional.softplus(logits) - y * logits)).sum()


def _train(z, y, weight, penalty: float, iterations: int, start=None) -> np.ndarray:
    """``[coef..., intercept]`` (float64) minimising the objective; ``start``: a previous solution to begin from
    (the next weaker penalty of a grid starts at the stronger one's optimum: the same minimum, fewer steps).

    SciPy's L-BFGS-B on the gradient written out, ``z^T (w * (sigmoid(z coef + b) - y)) + penalty * coef``: a step
    costs its two matrix-vector products and little else, where torch's L-BFGS with autograd cost several times the
    arithmetic on the small problems most fits are (a 400 x 270 fit with ``C="cv"``: 1.38 s before, 0.38 s now, one
    core). The products run in ``z``'s precision; only the parameter vector is float64."""
    import torch
    from scipy.optimize import minimize

    d = z.shape[1]
    total = float(weight.sum())

    def objective(theta):
        w = torch.from_numpy(theta[:d]).to(z.dtype)
        b = float(theta[d])
        logits = z @ w + b
        loss = float(_log_loss(logits, y, weight)) + 0.5 * penalty * float(w @ w)
        residual = weight * (torch.sigmoid(logits) - y)
        grad = np.empty(d + 1)
        grad[:d] = (residual @ z).double().numpy() + penalty * theta[:d]
        grad[d] = float(residual.sum())
        return loss / total, grad / total

    theta = np.zeros(d + 1) if start is None else start
    found = minimize(objective, theta, jac=True, method="L-BFGS-B",
                     options={"maxiter": iterations, "maxcor": 20, "gtol": 1e-7, "ftol": 1e-12})
    return found.x


def fit(x, labels, C: float | str = "cv", grid=C_GRID, groups=None, folds: int = 5, weights=None, seed: int = 0,
        iterations: int = 200) -> dict:
    """A logistic regression of 0/1 ``labels`` (or soft targets in [0, 1]) on ``x`` (``[n, d]``), on features
    standardised by the data's mean and deviation. ``C``: the inverse regularisation strength, or ``"cv"`` for
    the value of ``grid`` with the lowest held-out (weighted) log-loss over :func:`folds_of`. ``weights``: one per
    row (e.g. the inverse of the rate at which a subsampled class was kept). The chosen ``C`` is kept."""
    import torch

    big = np.size(x) > FLOAT64_ENTRIES
    dtype = torch.float32 if big else torch.float64
    x = torch.as_tensor(np.ascontiguousarray(x, dtype=np.float32 if big else np.float64))
    if x.ndim != 2:
        raise ValueError(f"expected features [n, d], got shape {tuple(x.shape)}")
    y = torch.as_tensor(np.asarray(labels, dtype=float)).to(dtype)
    weight = (torch.ones(len(y), dtype=dtype) if weights is None
              else torch.as_tensor(np.asarray(weights, dtype=float)).to(dtype))
    mean = x.mean(0)
    std = x.std(0, unbiased=False).clamp_min(1e-6)
    z = (x - mean) / std
    chosen = C
    if C == "cv":
        losses = {}
        splits = folds_of(np.asarray(labels) > 0.5, folds, groups, seed)
        for train, held in splits:  # along the path from the strongest penalty, each fit warm-started
            found = None
            for value in sorted(grid):
                found = _train(z[train], y[train], weight[train], 1.0 / value, iterations, found)
                w, b = torch.from_numpy(found[:-1]).to(dtype), float(found[-1])
                losses[value] = losses.get(value, 0.0) + float(_log_loss(z[held] @ w + b, y[held], weight[held]))
        chosen = min(grid, key=losses.get)  # the first of tied values in the grid's order, as before
    theta = _train(z, y, weight, 1.0 / float(chosen), iterations)
    return {"mean": pack(mean.numpy()), "std": pack(std.numpy()),
            "coef": pack(theta[:-1].astype(np.float32 if big else np.float64)), "intercept": float(theta[-1]),
            "C": float(chosen)}


def _array(value) -> np.ndarray:
    """A packed array, or a plain list (artifacts written before the packing)."""
    return unpack(value) if isinstance(value, dict) else np.asarray(value, dtype=float)


def coefficients(model: dict) -> np.ndarray:
    """The weights of a model, on standardised features."""
    return _array(model["coef"])


def logodds(model: dict, x) -> np.ndarray:
    """Log-odds of a fitted model on new features ``[n, d]``."""
    z = (np.asarray(x, dtype=float) - _array(model["mean"])) / _array(model["std"])
    return z @ _array(model["coef"]) + model["intercept"]
