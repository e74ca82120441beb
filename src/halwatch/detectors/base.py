"""The detector contract shared by every method.

A detector declares the signals it needs (:meth:`Detector.request`), so that one forward pass can feed many
detectors, and turns them into a raw score per response (higher = more likely hallucinated) and, where it can, a
score per response token. ``fit`` runs any supervised step of the method, then fits the calibration to
probabilities and the decision threshold (by its ``decision`` rule) on the probe data, and the token threshold used
for spans.
Nothing is hard-coded: an unfitted detector refuses to score.

A supervised method (one whose ``fit_method`` learns from the labels: head selection, a classifier) is calibrated
**out of fold**: the probe is split into stratified folds that keep the answers to one source document together
(:attr:`halwatch.sample.Sample.source`; answers of three generators to one RAGTruth source would otherwise sit on
both sides), a copy of the method is fitted on all folds but one and scores the one left out, and the calibration,
the decision threshold and the token threshold are fitted on those held-out scores. Scores of a model on its own
training data are overconfident (a 270-feature logistic regression separates 100 answers), and a calibration or
threshold fitted on them is biased. The method itself is then fitted on the whole probe.

The decision threshold follows the ``decision`` rule (the best F1, or a false-positive rate to hold); the
probabilities assume the probe's share of hallucinated answers unless a ``prior`` is given (the artifact states
which). Every verdict carries how far the answer's inputs lie from the training answers (:meth:`Detector.ood`).

Artifacts are small JSON files that record the detector, its settings and fitted state, the scoring model (name
and weights hash), the input mode and the token cap, and what it was fitted on.
"""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from typing import ClassVar

import numpy as np

from halwatch.detectors.calibration import Calibrator, best_f1_threshold, estimated_share
from halwatch.detectors.linear import folds_of
from halwatch.detectors.spans import PLAIN, fit_span_confidence, fit_span_rule, rule_spans
from halwatch.errors import HalwatchError, InputError
from halwatch.files import replaced
from halwatch.models.signal_types import SignalRequest, Signals
from halwatch.sample import Sample
from halwatch.signals import reducers
from halwatch.tokens import TokenView, window_groups

ARTIFACT_FORMAT = "halwatch-detector/1"
#: Quantiles of the training answers' distances that an artifact keeps for :meth:`Detector.ood`.
OOD_QUANTILES = (0.0, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0)
#: An answer farther from the training data than all but this share of the training answers is ``extrapolated``.
OOD_EXTRAPOLATED = 0.01
log = logging.getLogger("halwatch")


def cross_fit(folds, fit, predict, n: int) -> tuple[list, list]:
    """halwatch's one out-of-fold path: for each ``(train, held)`` of ``folds``, ``model = fit(train)`` and the
    held-out outputs ``predict(model, held)`` (one per index of ``held``). Returns the outputs in index order (``None``
    where no fold held an index) and ``[(model, held)]``."""
    out: list = [None] * n
    models = []
    for train, held in folds:
        model = fit(train)
        for i, value in zip(held, predict(model, held)):
            out[i] = value
        models.append((model, held))
    return out, models


def parse_decision(rule: str) -> tuple[str, float | None]:
    """A ``decision`` rule as ``(kind, target)``: ``"f1"`` -> ``("f1", None)``; ``"fpr=0.1"`` -> ``("fpr", 0.1)``
    (the share of the probe's grounded answers the threshold may flag); ``"mean-fpr=0.1"`` -> ``("mean-fpr", 0.1)``
    (the same share on average over the probe's datasets, each counted once whatever its size); ``"conformal
    fpr=0.1"`` (a threshold set by :meth:`Detector.recalibrate`) reads as ``fpr=0.1`` when refitted."""
    if rule == "f1":
        return "f1", None
    key, _, value = str(rule).removeprefix("conformal ").partition("=")
    try:
        target = float(value)
    except ValueError:
        target = -1.0
    if key not in ("fpr", "mean-fpr") or not 0 < target < 1:
        raise ValueError(f"decision: 'f1', 'fpr=A' or 'mean-fpr=A' with A in (0, 1), not {rule!r}")
    return key, target


def fpr_threshold(probs, labels, target: float, strata=None) -> float:
    """A threshold (predict 1 when ``prob >= t``) that flags as many grounded answers as a share ``target`` of
    them allows and no more: midway between the lowest grounded score it flags and the highest it does not.

    With ``strata`` (the dataset of each answer) the share is the mean over the strata of each stratum's share of
    grounded answers flagged: every grounded answer weighs ``1 / (strata x its stratum's grounded answers)``, so
    that a large set of answers that score low (short grounded answers) does not pull the threshold down for the
    others."""
    probs, labels = np.asarray(probs, dtype=float), np.asarray(labels)
    grounded = probs[labels == 0]
    if strata is None:
        weights = np.full(len(grounded), 1.0 / len(grounded))
    else:
        names, index, counts = np.unique(np.asarray(strata)[labels == 0], return_inverse=True, return_counts=True)
        weights = 1.0 / (len(names) * counts[index])
    order = np.argsort(-grounded, kind="stable")
    grounded, flagged = grounded[order], np.cumsum(weights[order])
    k = int(np.searchsorted(flagged, target * (1 + 1e-9), side="right"))  # the k highest may be flagged
    if k >= len(grounded):
        return float(grounded[-1])
    return float((grounded[k] + grounded[k - 1]) / 2) if k > 0 else float(np.nextafter(grounded[0], np.inf))


def groups_of(views) -> np.ndarray | None:
    """The source of each view's sample (:attr:`halwatch.sample.Sample.source`), for folds that keep a source
    together; ``None`` without views."""
    return None if views is None else np.array([v.sample.source for v in views])


def datasets_of(views) -> np.ndarray | None:
    """The dataset each view's sample comes from (``meta["dataset"]``, set by the named datasets' readers; one
    unnamed stratum for a user's own file), for the ``mean-fpr`` decision rule; ``None`` without views."""
    return None if views is None else np.array([str(v.sample.meta.get("dataset") or "") for v in views])


def operating_points(probs, labels, strata, threshold: float) -> dict:
    """Per stratum (dataset): its answers, its share hallucinated and the false- and true-positive rates at
    ``threshold`` of these (out-of-fold) probabilities."""
    probs, labels, strata = np.asarray(probs), np.asarray(labels), np.asarray(strata)
    out = {}
    for name in sorted(set(strata.tolist())):
        mine = strata == name
        flagged, y = probs[mine] >= threshold, labels[mine]
        out[name] = {"n": int(mine.sum()), "rate": round(float(y.mean()), 4),
                     "fpr": round(float(flagged[y == 0].mean()), 4) if (y == 0).any() else None,
                     "tpr": round(float(flagged[y == 1].mean()), 4) if (y == 1).any() else None}
    return out


def check_confidence(value) -> float:
    """A minimum span confidence: a number in [0, 1], or an :class:`InputError` saying so."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise InputError(f"min_span_confidence must be a number in [0, 1], not {value!r}") from None
    if not 0.0 <= value <= 1.0:
        raise InputError(f"min_span_confidence must be in [0, 1], not {value:g}")
    return value


def warn_precision(name: str, identity: dict, scorer) -> None:
    """One warning where a detector fitted on signals of one precision scores another's (it works: the scores move
    slightly, docs/scale.md "Device and precision" measures how much for the shipped default)."""
    fitted, own = identity.get("dtype", "float32"), scorer.identity()["dtype"]  # before the choice: float32
    if own != fitted:
        log.warning("detector %r was fitted on %s signals and scores %s ones here: its scores will differ slightly "
                    "from the fitted model's; --dtype %s scores as it was fitted (docs/scale.md, 'Device and "
                    "precision')", name, fitted, own, fitted)


class Detector:
    """Base class: subclasses set ``name`` and ``citation`` and implement ``request`` and ``raw_scores``
    (and optionally ``token_scores``, ``fit_method``, ``state``/``set_state``)."""

    name: ClassVar[str] = ""
    citation: ClassVar[str] = ""
    #: True when ``fit_method`` or ``fit_spans`` learns from labels: the calibration is then out of fold.
    supervised: ClassVar[bool] = False
    #: Folds of the out-of-fold calibration of a supervised method.
    calibration_folds: ClassVar[int] = 5

    def __init__(self, scorer=None, calibration: str = "platt", decision: str = "f1", prior: float | None = None,
                 **settings):
        self.scorer = scorer
        parse_decision(decision)
        if prior is not None and not 0 < float(prior) < 1:
            raise ValueError(f"prior: the share of hallucinated answers must be in (0, 1), not {prior}")
        self.decision_rule, self.prior = decision, None if prior is None else float(prior)
        self.settings = settings
        self.calibrator = Calibrator(calibration)
        self.threshold: float | None = None
        self.token_threshold: float | None = None
        self.span_rule: dict = dict(PLAIN)  # how token scores become spans (detectors.spans)
        self.span_calibration: dict | None = None  # a span's raw score -> its confidence (detectors.spans)
        self.min_span_confidence = 0.0  # spans below this confidence are left out of verdicts
        self.identity: dict = {}
        self.fitted_on: dict = {}
        self.ood_reference: dict | None = None  # see ood()

    @classmethod
    def setting_names(cls) -> set[str]:
        """Names of the settings this method takes (keyword arguments of its constructors)."""
        names: set[str] = set()
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is not None:
                names |= {n for n, p in inspect.signature(init).parameters.items()
                          if p.kind == p.POSITIONAL_OR_KEYWORD and n not in ("self", "scorer")}
        return names

    # ---- what a method implements -------------------------------------------------------------------------------
    def request(self) -> SignalRequest:
        """The signals that scoring needs (a fitted detector may ask for fewer than fitting does)."""
        raise NotImplementedError

    def fit_request(self) -> SignalRequest:
        """The signals that fitting needs: by default those of scoring. A method that selects heads asks for every
        head here, so that a fitted detector can be fitted again on new data."""
        return self.request()

    def raw_scores(self, signals: list[Signals]) -> np.ndarray:
        raise NotImplementedError

    def token_scores(self, signals: list[Signals]) -> list[np.ndarray] | None:
        """Per-response-token scores (higher = less supported), or ``None`` when the method has none."""
        return None

    def fit_method(self, signals: list[Signals], labels: np.ndarray) -> None:
        """The method's own supervised step (head selection, a classifier ...); nothing for unsupervised scores."""

    def fit_spans(self, signals: list[Signals], views: list[TokenView]) -> None:
        """The method's span-level supervised step on probe data with gold spans; nothing by default."""

    def continuation_scores(self, signals: list[Signals], start: int) -> np.ndarray:
        """Raw scores of candidate continuations whose new tokens begin at response token ``start`` (guided
        decoding): by default the score of the whole partial response."""
        return self.raw_scores(signals)

    def fit_held_out(self, folds: list, signals: list[Signals], views: list[TokenView] | None) -> None:
        """After the out-of-fold scores: fit any further threshold of the method on its held-out data. ``folds``:
        ``[(copy fitted without the fold, indices of the fold)]``. Nothing by default."""

    def fold_copy(self) -> "Detector":
        """An unfitted copy for one fold of the out-of-fold calibration: the same settings, with any
        hyper-parameter that the fit on the whole probe chose (e.g. a regularisation strength) fixed."""
        return type(self)(scorer=self.scorer, calibration=self.calibrator.method, decision=self.decision_rule,
                          prior=self.prior, **self.settings)

    def decision_threshold(self, probs: np.ndarray, labels: np.ndarray, strata=None) -> float:
        """The decision threshold on calibrated probabilities under the ``decision`` rule: ``f1``, the best F1 on
        the probe data; ``fpr=A``, the lowest threshold at which at most a share ``A`` of the probe's grounded
        answers is flagged (:func:`fpr_threshold`); ``mean-fpr=A``, the same with each of the ``strata`` (the
        dataset of each answer) weighing the same. All depend on the order of the scores alone, so the prior the
        probabilities assume does not move the verdicts."""
        kind, target = parse_decision(self.decision_rule)
        if kind == "f1":
            return best_f1_threshold(probs, labels)
        return fpr_threshold(probs, labels, target, strata if kind == "mean-fpr" else None)

    def state(self) -> dict:
        return {}

    def set_state(self, state: dict) -> None:
        pass

    # ---- the contract ---------------------------------------------------------------------------------------------
    def get_scorer(self):
        """The scorer given at construction, else one made from the artifact's identity (or the defaults; warning,
        as a given one does, where its precision is not the fitted one's)."""
        if self.scorer is None:
            from halwatch.scorer import Scorer

            self.scorer = Scorer.from_options(identity=self.identity)
            if self.identity:
                warn_precision(self.name, self.identity, self.scorer)
        return self.scorer

    def _signals(self, samples, progress=False, views=None):
        return self.get_scorer().signals(samples, self.request(), progress=progress, views=views)

    def fit_signals(self, signals: list[Signals], labels, views: list[TokenView] | None = None,
                    groups=None, scored=None) -> "Detector":
        """Fit on precomputed signals (the benchmark harness feeds many detectors from one pass this way).
        ``groups``: the source of each answer, so that no fold parts one source's answers (default: the sources of
        the ``views``' samples). ``scored``: ``(views, signals)`` of the same answers as scoring sees them
        (:meth:`halwatch.scorer.Scorer.windowed`: a context longer than the token cap in its windows); the method
        is fitted on the one view of each answer, and the calibration, the threshold, the span rule and the OOD
        reference on the held-out scores of the answers as scored (:meth:`_as_scored`), so that the operating
        point holds for answers scored in windows too (a supervised method; an unsupervised one's score is
        calibrated on the one view)."""
        labels = np.asarray(labels, dtype=int)
        if len(labels) != len(signals):
            raise ValueError(f"{len(signals)} samples but {len(labels)} labels")
        if len(np.unique(labels)) < 2:
            raise InputError("the probe data needs both hallucinated (1) and grounded (0) samples")
        groups = np.asarray(groups) if groups is not None else groups_of(views)
        strata = datasets_of(views)
        if views is not None and not any(v.sample.spans for v in views):
            views = None  # no gold spans: nothing span-level to fit
        self.fit_parts(signals, labels, views, groups)
        if self.supervised:
            raw, tokens = self.held_out_scores(signals, labels, views, groups)
        else:
            raw, tokens = self.raw_scores(signals), self.token_scores(signals)
        inputs = self.ood_inputs_held_out(signals, raw)
        windowed = 0
        if scored is not None and self.supervised:  # (an unsupervised score is calibrated as it is)
            raw, tokens, inputs, windowed = self._as_scored(scored, raw, tokens, inputs)
        self._fold_models = None
        self.calibrator.fit(raw, labels, oriented=self.supervised, prior=self.prior)
        probs = self.calibrator.transform(raw)
        self.threshold = self.decision_threshold(probs, labels, strata)
        self.fit_ood(inputs)
        span_fit = None
        if tokens is not None:
            self.token_threshold, self.span_rule, span_fit = self._fit_token_rule(tokens, probs, labels, views)
        self.fitted_on = {"n": int(len(labels)), "n_hallucinated": int(labels.sum()),
                          "n_sources": int(len(np.unique(groups))) if groups is not None else None,
                          "calibration": "out-of-fold, folds by source" if self.supervised and groups is not None
                          else "out-of-fold" if self.supervised else "in-sample (unsupervised score)",
                          "decision": self.decision_rule, "prior": self.calibrator.params.get("prior")}
        if windowed:
            self.fitted_on["windowed"] = windowed  # answers calibrated in the windows of their long context
        if strata is not None and len(set(strata)) > 1:
            self.fitted_on["by_dataset"] = operating_points(probs, labels, strata, self.threshold)
        if span_fit:
            self.fitted_on["span_fit"] = span_fit
        if self.scorer is not None:
            self.identity = {**self.scorer.identity(), "signal_versions": reducers.versions(self.request().reducers)}
        return self

    def fit_parts(self, signals: list[Signals], labels: np.ndarray, views: list[TokenView] | None,
                  groups=None) -> None:
        """The method's own fitting: :meth:`fit_method`, then :meth:`fit_spans` where there are gold spans."""
        self.fit_method(signals, labels)
        if views is not None:
            self.fit_spans(signals, views)

    def held_out_scores(self, signals, labels, views, groups=None) -> tuple[np.ndarray, list | None]:
        """Raw and token scores of the probe, each from a copy of the method fitted without it: stratified folds
        by source (as many as the smaller class allows, at most :attr:`calibration_folds`), shuffled with a fixed
        seed, through :func:`cross_fit`."""
        def fit(train):
            copy = self.fold_copy()
            copy.fit_parts([signals[i] for i in train], labels[train],
                           None if views is None else [views[i] for i in train],
                           None if groups is None else groups[train])
            return copy

        def predict(copy, held):
            held_signals = [signals[i] for i in held]
            tokens = copy.token_scores(held_signals) or [None] * len(held)
            return list(zip(copy.raw_scores(held_signals), tokens))

        out, folds = cross_fit(folds_of(labels, self.calibration_folds, groups), fit, predict, len(labels))
        self.fit_held_out(folds, signals, views)
        self._fold_models = folds
        raw = np.array([r for r, _ in out], dtype=float)
        tokens = [t for _, t in out]
        return raw, None if any(t is None for t in tokens) else tokens

    def fold_models(self) -> list[tuple["Detector", list]]:
        """``[(detector, held)]``: after :meth:`held_out_scores`, each fold's copy fitted without the answers
        ``held``."""
        if not getattr(self, "_fold_models", None):
            raise RuntimeError("fold_models: only during fit_signals, after held_out_scores")
        return self._fold_models

    def _as_scored(self, scored, raw, tokens, inputs) -> tuple[np.ndarray, list | None, np.ndarray, int]:
        """The held-out ``(raw scores, token scores, OOD inputs)`` of the probe with each answer that ``scored``
        gives in several windows of its long context rescored that way (:meth:`answer_outputs`) by the fold model
        that did not see it, and how many there were. halwatch's own step (the papers' contexts fit the model):
        fitted on one left-cut view each, an answer scores higher than in windows, where its most supportive
        window counts, so a threshold fitted on one view flagged more answers scored in windows than it was set
        for."""
        flat_views, flat_signals = scored
        found = window_groups(flat_views)
        if len(found) != len(raw):
            raise ValueError(f"scored: {len(found)} answers in their windows, but {len(raw)} fitted")
        if all(len(g) == 1 for g in found):
            return raw, tokens, inputs, 0
        raw, inputs = np.array(raw, dtype=float), np.array(inputs, dtype=float)
        tokens = None if tokens is None else list(tokens)
        for det, held in self.fold_models():
            mine = [i for i in held if len(found[i]) > 1]
            if not mine:
                continue
            flat = [k for i in mine for k in found[i]]
            _, r, t, x = det.answer_outputs([flat_views[k] for k in flat], [flat_signals[k] for k in flat])
            for j, i in enumerate(mine):
                raw[i], inputs[i] = r[j], x[j]
                if tokens is not None:
                    tokens[i] = t[j]
        return raw, tokens, inputs, sum(len(g) > 1 for g in found)

    # ---- how far an input lies from the training data ----------------------------------------------------------
    def ood_inputs(self, signals: list[Signals]) -> np.ndarray:
        """``[n, k]``: the inputs whose distance from the training data :meth:`ood` reports; by default the raw
        score (a method with several inputs to its last step reports those)."""
        return np.asarray(self.raw_scores(signals), dtype=float)[:, None]

    def ood_inputs_held_out(self, signals, raw) -> np.ndarray:
        """The training answers' own :meth:`ood_inputs`, held out where the method has held-out values."""
        return np.asarray(raw, dtype=float)[:, None]

    def fit_ood(self, inputs: np.ndarray) -> None:
        """The reference of :meth:`ood`: the mean and deviation of each input over the training answers and
        quantiles of their distances."""
        inputs = np.asarray(inputs, dtype=float)
        mean, std = inputs.mean(0), inputs.std(0) + 1e-9
        distances = np.sqrt((((inputs - mean) / std) ** 2).mean(1))
        self.ood_reference = {"mean": mean.tolist(), "std": std.tolist(),
                              "distances": np.quantile(distances, OOD_QUANTILES).round(6).tolist()}

    def ood(self, signals: list[Signals]) -> list[dict] | None:
        """Per answer: ``distance`` (root mean square of the z-scores of :meth:`ood_inputs` against the training
        answers), ``percentile`` (the share of training answers that lie nearer, from stored quantiles) and
        ``extrapolated`` (farther than all but :data:`OOD_EXTRAPOLATED` of the training answers). ``None`` for a
        detector fitted before this was recorded."""
        return self.ood_from_inputs(self.ood_inputs(signals)) if self.ood_reference else None

    def ood_from_inputs(self, inputs: np.ndarray) -> list[dict]:
        """:meth:`ood` of given :meth:`ood_inputs` rows."""
        ref = self.ood_reference
        z = (np.asarray(inputs, dtype=float) - np.array(ref["mean"])) / np.array(ref["std"])
        distances = np.sqrt((z ** 2).mean(1))
        cut = np.interp(1 - OOD_EXTRAPOLATED, OOD_QUANTILES, ref["distances"])
        return [{"distance": round(float(d), 3),
                 "percentile": round(float(np.interp(d, ref["distances"], OOD_QUANTILES)), 3),
                 "extrapolated": bool(d > cut)} for d in distances]

    def _fit_token_rule(self, tokens, probs, labels, views) -> tuple[float, dict, dict | None]:
        """``(token threshold, span rule, probe span figures)``. Where the probe data has gold spans, the rule with
        the best character-level span F1 on the probe's (held-out) token and answer scores
        (:mod:`halwatch.detectors.spans`) among those that give a span to at most one in ten grounded probe answers,
        and the spans' confidence calibration; otherwise the plain rule at the 95th
        percentile of token scores in grounded probe responses (a token is flagged when it is rarer than that in
        grounded answers), and no figures."""
        if views is not None:  # fit_signals keeps views only when the probe has gold spans
            keep = [i for i, v in enumerate(views) if v.has_token_labels]  # not answers flagged without spans
            tokens, views, probs = [tokens[i] for i in keep], [views[i] for i in keep], probs[keep]
            threshold, rule, fit = fit_span_rule(tokens, views, probs, self.threshold)
            self.span_calibration, fit["confidence"] = fit_span_confidence(tokens, views, probs, self.threshold,
                                                                            threshold, rule)
            return threshold, rule, fit
        grounded = [t for t, label in zip(tokens, labels) if label == 0]
        return float(np.quantile(np.concatenate(grounded), 0.95)), dict(PLAIN), None

    def fit(self, samples: list[Sample], labels=None, progress: bool = False) -> "Detector":
        """Fit on labelled samples (``labels`` default to each sample's ``label``)."""
        if labels is None:
            if any(s.label is None for s in samples):
                missing = next(s for s in samples if s.label is None)
                raise InputError("sample has no label; fitting needs a label on every sample", missing.where)
            labels = [s.label for s in samples]
        scorer = self.get_scorer()
        views = [scorer.encode(s) for s in samples]
        signals = scorer.signals(samples, self.fit_request(), progress=progress, views=views)
        return self.fit_signals(signals, labels, views, scored=self.scored_views(views, signals, progress))

    def scored_views(self, views, signals, progress: bool = False):
        """:meth:`fit_signals`'s ``scored`` for training answers (one view and its signals each): them as scoring
        sees them (:meth:`halwatch.scorer.Scorer.windowed`), or ``None`` where the method is unsupervised (its
        score is calibrated on the one view) or there are no views."""
        if not self.supervised or views is None:
            return None
        return self.get_scorer().windowed(views, signals, self.fit_request(), progress)

    def recalibrate(self, raw, labels, target_fpr: float | None = None, describe: str = "", tasks=None) -> dict:
        """Fit this detector's probabilities and decision threshold anew on a user's own labelled answers (the
        method itself is kept), given their raw scores as scoring computes them (:meth:`answer_outputs`, long
        contexts in windows): Platt scaling on the raw scores of these answers (their share of hallucinated
        answers is the prior the probabilities then assume) and, with ``target_fpr``, the split-conformal threshold
        that holds that false-positive rate on answers like these (:func:`conformal_threshold`), else the best F1
        on them. Returns what was reached on these answers and the guarantee's terms. ``tasks`` (each answer's
        :func:`halwatch.sample.task_of`) matter only to a detector with one part per task."""
        from halwatch.detectors.calibration import conformal_threshold

        self._require_fitted()
        labels = np.asarray(labels, dtype=int)
        raw = np.asarray(raw, dtype=float)
        calibrator = Calibrator(self.calibrator.method).fit(raw, labels, oriented=self.supervised)
        probs = calibrator.transform(raw)
        report: dict = {"n": int(len(labels)), "n_hallucinated": int(labels.sum())}
        if target_fpr is None:
            threshold = best_f1_threshold(probs, labels)
        else:
            threshold, guarantee = conformal_threshold(probs[labels == 0], target_fpr)
            # the guarantee's n counts the grounded answers: kept apart from the n of all answers
            report |= {"target_fpr": target_fpr, "n_grounded": guarantee.pop("n"), **guarantee}
        self.calibrator, self.threshold = calibrator, threshold
        self.decision_rule = "f1" if target_fpr is None else f"conformal fpr={target_fpr}"
        flagged = probs >= threshold
        report |= {"threshold": threshold, "fpr": float(flagged[labels == 0].mean()),
                   "tpr": float(flagged[labels == 1].mean()) if labels.any() else None}
        self.fitted_on = {**self.fitted_on, "recalibrated": {**report, "data": describe}}
        return report

    def assumed_prior(self) -> float:
        """The share of hallucinated answers this detector's probabilities assume: the calibration's ``prior`` (for
        an artifact written before that was kept, :meth:`from_dict` sets the share of its training answers)."""
        if "prior" in self.calibrator.params:
            return float(self.calibrator.params["prior"])
        raise HalwatchError(f"detector {self.name!r}: the artifact does not say which share of hallucinated answers "
                            f"its probabilities assume; fit it again")

    def restate_prior(self, prior: float | None = None, probs=None, describe: str = "", tasks=None) -> dict:
        """Let the probabilities assume another share of hallucinated answers, keeping every verdict and span: the
        share ``prior`` a user states, or the one estimated from ``probs``, the probabilities (as scoring gives
        them) of unlabelled answers like those to be judged (:func:`estimate_prior`, with a 90 % bootstrap
        interval). The calibrated log-odds move by ``logit(new) - logit(old)`` and the threshold with them
        (:meth:`Calibrator.restate`), so that the order of the answers, the flagged ones and their spans stay as
        fitted. Use it when the answers to be judged hold another share of hallucinated ones than the training
        answers (RAGTruth's official test split: 26 %, against 46 % in its training split); it assumes that this
        share is all that differs. ``tasks`` matter only to a detector with one part per task."""
        from halwatch.detectors.logistic import logit, sigmoid

        self._require_fitted()
        report = {"assumed": self.assumed_prior()}
        if prior is None:
            report |= estimated_share(probs, report["assumed"])
            prior = report["estimate"]
        move = self.calibrator.restate(float(prior))
        self.threshold = float(sigmoid(logit(self.threshold) + move))
        report |= {"prior": float(prior), "threshold": self.threshold}
        self.fitted_on = {**self.fitted_on, "restated": {**report, "data": describe}}
        return report

    def _require_fitted(self):
        if self.threshold is None:
            raise HalwatchError(f"detector {self.name!r} is not fitted: call fit() or load a fitted artifact")

    def score_signals(self, signals: list[Signals]) -> np.ndarray:
        """Probability of hallucination of each response."""
        return self.scores_and_ranking(signals)[0]

    def scores_and_ranking(self, signals: list[Signals]) -> tuple[np.ndarray, np.ndarray]:
        """``(probabilities, ranking)``: the calibrated probabilities, and the score that ranks answers in the
        benchmark (the raw score, turned the way the calibration runs; see :meth:`Calibrator.ranking`)."""
        self._require_fitted()
        raw = np.asarray(self.raw_scores(signals), dtype=float)
        return self.calibrator.transform(raw), self.calibrator.ranking(raw)

    def score(self, samples: list[Sample], progress: bool = False) -> np.ndarray:
        """Probability of hallucination of each sample's response."""
        self._require_fitted()
        return self.answer_scores(*self._encoded(samples, progress))[1]

    def _encoded(self, samples: list[Sample], progress: bool = False) -> tuple[list[TokenView], list[Signals]]:
        """``(views, signals)`` of ``samples`` as ``halwatch score`` sees them: each in the windows of its long
        context (:meth:`halwatch.scorer.Scorer.encode_windows`)."""
        views = [v for found in self.get_scorer().encode_many(samples) for v in found]
        return views, self._signals([v.sample for v in views], progress, views)

    def answers(self, samples: list[Sample], progress: bool = False
                ) -> tuple[list[TokenView], np.ndarray, list | None, np.ndarray]:
        """:meth:`answer_outputs` of ``samples``, one answer per sample."""
        return self.answer_outputs(*self._encoded(samples, progress))

    def predict(self, samples: list[Sample]) -> np.ndarray:
        _, probs, _, thresholds, _ = self.answer_scores(*self._encoded(samples))
        return probs >= thresholds

    def for_task(self, task: str) -> "Detector":
        """The detector that judges answers of ``task`` (:data:`halwatch.sample.TASKS`): this one; a detector with
        one part per task gives that part."""
        return self

    def answer_scores(self, views: list[TokenView], signals: list[Signals]
                      ) -> tuple[list[TokenView], np.ndarray, np.ndarray, np.ndarray, list | None]:
        """Per answer (:meth:`answer_outputs`: consecutive views may be windows of one answer): ``(views,
        probabilities, ranking scores, thresholds, token scores or None)``. The ranking scores order answers in a
        benchmark (see :meth:`Calibrator.ranking`); every answer's threshold is :attr:`threshold` here, its part's
        in a detector with one part per task."""
        self._require_fitted()
        views, raw, tokens, _ = self.answer_outputs(views, signals)
        return (views, self.calibrator.transform(raw), self.calibrator.ranking(raw),
                np.full(len(views), float(self.threshold)), tokens)

    def outputs(self, signals: list[Signals]) -> tuple[np.ndarray, list | None, np.ndarray]:
        """``(raw scores, token scores or None, OOD inputs)`` of a batch: everything a verdict needs, computed in one
        go so that a method can share the work (the fused detector's answer score pools its token scores: its token
        model runs once). By default each comes from its own method; a method that overrides :meth:`ood_inputs`
        overrides this too."""
        raw = np.asarray(self.raw_scores(signals), dtype=float)
        return raw, self.token_scores(signals), raw[:, None]

    def answer_outputs(self, views: list[TokenView], signals: list[Signals]
                       ) -> tuple[list[TokenView], np.ndarray, list | None, np.ndarray]:
        """:meth:`outputs` per answer, where consecutive ``views`` (and their ``signals``) may be the windows of one
        answer's long context (:func:`halwatch.tokens.encode_windows`): an answer's raw score and OOD inputs are
        those of its most supportive window (the lowest score), and each of its tokens scores the lowest that any
        window gives it (a word is supported when some window supports it). Returns each answer's last view (all
        its windows share its response and tokens), raw scores, token scores and OOD inputs.

        This is halwatch's own rule, not a published method's: the papers score a context that fits the model.
        Where an answer's support is spread over several windows, each window alone sees part of it, so the answer
        score leans to "hallucinated"; the lexical-support features see the whole context in every window."""
        raw, tokens, inputs = self.outputs(signals)
        groups = window_groups(views)
        if all(len(g) == 1 for g in groups):
            return views, raw, tokens, inputs
        ranking = self.calibrator.ranking(raw)
        picks = [g[int(np.argmin(ranking[g]))] for g in groups]
        if tokens is not None:
            tokens = [np.min(np.stack([np.asarray(tokens[i], dtype=float) for i in g]), axis=0) for g in groups]
        return [views[g[-1]] for g in groups], raw[picks], tokens, inputs[picks]

    def spans_from(self, view: TokenView, signals: Signals, prob: float | None = None,
                   min_confidence: float = 0.0) -> list[dict]:
        """The flagged word spans of one response under the fitted span rule, with their confidence (calibrated
        where the detector was fitted on human spans), less those below ``min_confidence``; ``prob``, the
        response's probability of hallucination, is computed when it is not given."""
        self._require_fitted()
        raw, tokens, _ = self.outputs([signals])
        if prob is None:
            prob = float(self.calibrator.transform(raw)[0])
        return self.token_spans(view, None if tokens is None else tokens[0], prob, min_confidence)

    def token_spans(self, view: TokenView, tokens, prob: float, min_confidence: float = 0.0) -> list[dict]:
        """:meth:`spans_from` with the response's token scores (``None``: the method has none) and probability
        given."""
        if tokens is None or self.token_threshold is None:
            return []
        fitted = self.calibrator.as_fitted  # the span rule was fitted before any restated prior
        return rule_spans(view, tokens, float(fitted(prob)), float(fitted(self.threshold)), self.token_threshold,
                          self.span_rule, self.span_calibration, min_confidence)

    def verdicts(self, views: list[TokenView], signals: list[Signals],
                 min_span_confidence: float | None = None) -> list[dict]:
        """What ``halwatch score`` and the service report for each response: ``id``, ``score`` (probability of
        hallucination), ``hallucinated`` (score >= ``threshold``), ``threshold``, ``spans`` (character offsets into
        the response, Python string indices = Unicode code points, with the text and a confidence; those below
        ``min_span_confidence`` left out, by default :attr:`min_span_confidence`), the detector,
        scoring model and input mode, and ``truncated``: how many context tokens were cut to fit the token cap
        (the response is never cut), and ``windows``: how many windows of a long context the answer was scored
        against (:meth:`answer_outputs`; consecutive ``views`` of one answer's windows give one verdict). The
        batch's scores, token scores and OOD inputs are computed once (:meth:`outputs`)."""
        self._require_fitted()
        views, raw, tokens, ood_inputs = self.answer_outputs(views, signals)
        probs = self.calibrator.transform(raw)
        ood = self.ood_from_inputs(ood_inputs) if self.ood_reference else [None] * len(views)
        tokens = tokens if tokens is not None else [None] * len(views)
        if min_span_confidence is None:
            min_span_confidence = self.min_span_confidence
        return [{"id": view.sample.id, "score": round(float(p), 4), "hallucinated": bool(p >= self.threshold),
                 "threshold": round(float(self.threshold), 4),
                 "spans": self.token_spans(view, t, float(p), min_span_confidence),
                 "detector": self.name,
                 "scoring_model": self.identity.get("scoring_model", self.get_scorer().model.name),
                 "input_mode": view.input_mode, "truncated": view.cut_tokens, "windows": view.window[1],
                 **({"ood": far} if far is not None else {})}
                for view, t, p, far in zip(views, tokens, probs, ood)]

    def spans(self, sample: Sample) -> list[dict]:
        """Character spans of ``sample.response`` that the detector flags: ``[{start, end, text, confidence}]``."""
        self._require_fitted()
        (view,), probs, _, _, tokens = self.answer_scores(*self._encoded([sample]))
        return self.token_spans(view, None if tokens is None else tokens[0], float(probs[0]),
                                self.min_span_confidence)

    # ---- artifacts ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        self._require_fitted()
        return {
            "format": ARTIFACT_FORMAT,
            "detector": self.name,
            "citation": self.citation,
            **self.identity,
            "settings": self.settings,
            "decision": self.decision_rule,
            "prior": self.prior,
            "calibration": self.calibrator.to_dict(),
            "threshold": self.threshold,
            "token_threshold": self.token_threshold,
            "span_rule": self.span_rule,
            "span_calibration": self.span_calibration,
            "min_span_confidence": self.min_span_confidence,
            "state": self.state(),
            "ood_reference": self.ood_reference,
            "fitted_on": self.fitted_on,
        }

    def save(self, path: str | Path) -> None:
        with replaced(path) as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def from_dict(cls, d: dict, scorer=None, precision_warning: bool = True) -> "Detector":
        """The detector an artifact describes, checked against ``scorer``: a different input mode or model is
        refused; a different precision works, with one warning (``precision_warning=False``: the caller warns
        once for several artifacts, as a routed detector does for its parts)."""
        det = cls(scorer=scorer, calibration=d["calibration"]["method"], decision=d.get("decision", "f1"),
                  prior=d.get("prior"), **d.get("settings", {}))
        det.ood_reference = d.get("ood_reference")
        det.calibrator = Calibrator.from_dict(d["calibration"])
        det.threshold = d["threshold"]
        det.token_threshold = d.get("token_threshold")
        det.span_rule = {**PLAIN, **d.get("span_rule", {})}  # artifacts from before the rule: the plain one
        det.span_calibration = d.get("span_calibration")
        det.min_span_confidence = check_confidence(d.get("min_span_confidence", 0.0))
        det.identity = {k: d[k] for k in ("scoring_model", "weights_sha256", "input_mode", "max_tokens", "dtype",
                                          "signal_versions") if k in d}
        stale = {name: v for name, v in det.identity.get("signal_versions", {}).items()
                 if reducers.REDUCERS.get(name) is None or reducers.REDUCERS[name].version != v}
        if stale:
            now = reducers.versions([name for name in stale if name in reducers.REDUCERS])
            raise HalwatchError(f"detector {d['detector']!r} was fitted on older definitions of the signals {stale} "
                                f"(this halwatch computes {now}): fit it again (`halwatch fit`)")
        det.fitted_on = d.get("fitted_on", {})
        if "prior" not in det.calibrator.params and det.fitted_on.get("n"):  # written before the prior was kept:
            det.calibrator.params["prior"] = det.fitted_on["n_hallucinated"] / det.fitted_on["n"]  # its training's
        det.set_state(d.get("state", {}))
        if scorer is not None and det.identity:
            for key in ("input_mode", "weights_sha256"):  # the mode first: its refusal comes before the model loads
                mine = scorer.input_mode if key == "input_mode" else scorer.identity()[key]
                if mine != det.identity[key]:
                    raise HalwatchError(
                        f"detector was fitted with {key}={det.identity[key]} ({det.identity['scoring_model']}), "
                        f"but the scorer has {key}={mine}: fit it again for this setting (`halwatch fit`)"
                    )
            if precision_warning:
                warn_precision(d["detector"], det.identity, scorer)
        return det
