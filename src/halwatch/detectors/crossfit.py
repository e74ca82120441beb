"""halwatch's one out-of-fold path.

A supervised method (one that learns from the labels: head selection, a classifier) is calibrated **out of fold**:
the probe is split into stratified folds that keep the answers to one source document together
(:attr:`halwatch.sample.Sample.source`; answers of three generators to one RAGTruth source would otherwise sit on
both sides), a copy of the method is fitted on all folds but one and scores the one left out, and the calibration,
the decision threshold, the span rule and the out-of-distribution reference are fitted on those held-out scores.
Scores of a model on its own training data are overconfident (a 270-feature logistic regression separates 100
answers), and a calibration or threshold fitted on them is biased.

:func:`cross_fit` is the loop; :class:`OutOfFold` is what a method's out-of-fold fit hands back (the held-out raw
scores, token scores and OOD inputs, and each fold's model with the answers it did not see), returned, never
stashed, so that nothing depends on the order of two calls; :func:`by_copies` is the default way to get one
(:meth:`halwatch.detectors.base.Detector.fit_out_of_fold`), which the fused detector replaces with its own
stacking; :func:`as_scored` rescores the held-out answers that scoring sees in windows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from halwatch.detectors.linear import folds_of
from halwatch.tokens import window_groups


def cross_fit(folds, fit, predict, n: int) -> tuple[list, list]:
    """For each ``(train, held)`` of ``folds``, ``model = fit(train)`` and the held-out outputs ``predict(model,
    held)`` (one per index of ``held``). Returns the outputs in index order (``None`` where no fold held an index)
    and ``[(model, held)]``."""
    out: list = [None] * n
    models = []
    for train, held in folds:
        model = fit(train)
        for i, value in zip(held, predict(model, held)):
            out[i] = value
        models.append((model, held))
    return out, models


@dataclass
class OutOfFold:
    """A method's scores of its probe, each from a model that did not see the answer (in sample for an
    unsupervised method, whose ``folds`` are empty). ``raw``: answer scores; ``tokens``: token scores per answer or
    ``None``; ``inputs``: ``[n, k]`` OOD inputs (the raw score as one column by default); ``folds``:
    ``[(detector fitted without them, indices of the answers it held out)]``."""

    raw: np.ndarray
    tokens: list | None
    inputs: np.ndarray
    folds: list = field(default_factory=list)


def by_copies(detector, signals, labels, views, groups=None) -> OutOfFold:
    """The default out-of-fold fit: stratified folds by source (as many as the smaller class allows, at most the
    detector's ``calibration_folds``), shuffled with a fixed seed; in each, an unfitted copy of the detector
    (:meth:`~halwatch.detectors.base.Detector.fold_copy`) fitted without the fold scores it."""
    def fit(train):
        copy = detector.fold_copy()
        copy.fit_parts([signals[i] for i in train], labels[train],
                       None if views is None else [views[i] for i in train],
                       None if groups is None else groups[train])
        return copy

    def predict(copy, held):
        held_signals = [signals[i] for i in held]
        tokens = copy.token_scores(held_signals) or [None] * len(held)
        return list(zip(copy.raw_scores(held_signals), tokens))

    out, folds = cross_fit(folds_of(labels, detector.calibration_folds, groups), fit, predict, len(labels))
    raw = np.array([r for r, _ in out], dtype=float)
    tokens = [t for _, t in out]
    return OutOfFold(raw, None if any(t is None for t in tokens) else tokens, raw[:, None], folds)


def as_scored(held: OutOfFold, scored) -> tuple[OutOfFold, int]:
    """``held`` with each answer that ``scored`` (``(views, signals)`` of the probe as scoring sees them) gives in
    several windows of its long context rescored that way (the detector's ``answer_outputs``) by the fold model
    that did not see it, and how many there were. halwatch's own step (the papers' contexts fit the model): fitted
    on one left-cut view each, an answer scores higher than in windows, where its most supportive window counts, so
    a threshold fitted on one view flagged more answers scored in windows than it was set for."""
    flat_views, flat_signals = scored
    found = window_groups(flat_views)
    if len(found) != len(held.raw):
        raise ValueError(f"scored: {len(found)} answers in their windows, but {len(held.raw)} fitted")
    if all(len(g) == 1 for g in found):
        return held, 0
    raw, inputs = np.array(held.raw, dtype=float), np.array(held.inputs, dtype=float)
    tokens = None if held.tokens is None else list(held.tokens)
    for det, indices in held.folds:
        mine = [i for i in indices if len(found[i]) > 1]
        if not mine:
            continue
        flat = [k for i in mine for k in found[i]]
        _, r, t, x = det.answer_outputs([flat_views[k] for k in flat], [flat_signals[k] for k in flat])
        for j, i in enumerate(mine):
            raw[i], inputs[i] = r[j], x[j]
            if tokens is not None:
                tokens[i] = t[j]
    return OutOfFold(raw, tokens, inputs, held.folds), sum(len(g) > 1 for g in found)
