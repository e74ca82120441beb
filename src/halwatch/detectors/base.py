"""The detector contract shared by every method.

A detector is a method composed with the parts that turn its scores into verdicts, the way scikit-learn composes an
estimator with ``CalibratedClassifierCV``:

- the **method** (each subclass): declares the signals it needs (:meth:`Detector.request`), so that one forward
  pass can feed many detectors, fits its own supervised step (:meth:`fit_method`, :meth:`fit_spans`) and turns
  signals into a raw score per response (higher = more likely hallucinated) and, where it can, a score per response
  token (:meth:`raw_scores`, :meth:`token_scores`);
- its **operating point** (:class:`~halwatch.detectors.operating.OperatingPoint`, ``self.operating``): the
  calibration to probabilities, the decision rule and threshold, and the share of hallucinated answers the
  probabilities assume;
- its **span rule** (:class:`~halwatch.detectors.spans.SpanRule`, ``self.span``): token scores to word spans with a
  calibrated confidence;
- its **out-of-distribution reference** (:class:`~halwatch.detectors.ood.OODReference`, ``self.reference``).

Each part has its own small contract and artifact section. :meth:`Detector.fit_signals` fits the method, gets its
out-of-fold scores from one place (:mod:`halwatch.detectors.crossfit`: a supervised method is calibrated out of fold,
folds by source) and fits the three parts on them. Nothing is hard-coded: an unfitted detector refuses to score.

The public surface of a detector, beside the method contract above:

- fitting: :meth:`fit` (labelled samples), :meth:`fit_signals` (precomputed signals);
- scoring: :meth:`score` (probabilities of samples), :meth:`answer_scores` (per answer, from views and signals:
  probabilities, ranking scores, thresholds, token scores), :meth:`verdicts` (what ``halwatch score`` reports);
- the operating point on a user's data: :meth:`recalibrate`, :meth:`restate_prior`;
- :meth:`for_task` (the part that judges a task; the detector itself unless it has one per task);
- artifacts: :meth:`save` / :meth:`to_dict`, :meth:`from_dict`.

Artifacts are small JSON files that record the detector, its settings and fitted state, the scoring model (name
and weights hash), the input mode and the token cap, what it was fitted on, and each part's section.
"""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from typing import ClassVar

import numpy as np

from halwatch.detectors import crossfit
from halwatch.detectors.ood import OODReference, held_out_auroc
from halwatch.detectors.operating import OperatingPoint, operating_points
from halwatch.detectors.spans import SpanRule
from halwatch.errors import HalwatchError, InputError
from halwatch.files import replaced
from halwatch.models.signal_types import SignalRequest, Signals
from halwatch.sample import Sample
from halwatch.sentences import sentence_ranges
from halwatch.signals import reducers
from halwatch.tokens import TokenView, window_groups

ARTIFACT_FORMAT = "halwatch-detector/1"
log = logging.getLogger("halwatch")


def groups_of(views) -> np.ndarray | None:
    """The source of each view's sample (:attr:`halwatch.sample.Sample.source`), for folds that keep a source
    together; ``None`` without views."""
    return None if views is None else np.array([v.sample.source for v in views])


def datasets_of(views) -> np.ndarray | None:
    """The dataset each view's sample comes from (``meta["dataset"]``, set by the named datasets' readers; one
    unnamed stratum for a user's own file), for the ``mean-fpr`` decision rule; ``None`` without views."""
    return None if views is None else np.array([str(v.sample.meta.get("dataset") or "") for v in views])


def warn_precision(name: str, identity: dict, scorer) -> None:
    """One warning where a detector fitted on signals of one precision scores another's (it works: the scores move
    slightly, docs/scale.md "Device and precision" measures how much for the shipped default)."""
    fitted, own = identity.get("dtype", "float32"), scorer.identity()["dtype"]  # before the choice: float32
    if own != fitted:
        log.warning("detector %r was fitted on %s signals and scores %s ones here: its scores will differ slightly "
                    "from the fitted model's; --dtype %s scores as it was fitted (in Python: dtype=\"%s\"; "
                    "docs/scale.md, 'Device and precision')", name, fitted, own, fitted, fitted)


class Detector:
    """Base class: subclasses set ``name`` and ``citation`` and implement ``request`` and ``raw_scores`` (and
    optionally ``token_scores``, ``fit_method``, ``fit_spans``, ``state``/``set_state``); see the module docstring
    for the parts every detector holds and its public surface."""

    name: ClassVar[str] = ""
    citation: ClassVar[str] = ""
    #: True when ``fit_method`` or ``fit_spans`` learns from labels: the calibration is then out of fold.
    supervised: ClassVar[bool] = False
    #: Folds of the out-of-fold calibration of a supervised method.
    calibration_folds: ClassVar[int] = 5

    def __init__(self, scorer=None, calibration: str = "platt", decision: str = "f1", prior: float | None = None,
                 **settings):
        self.scorer = scorer
        self.operating = OperatingPoint(calibration, decision, prior)
        self.span = SpanRule()
        self.reference: OODReference | None = None
        self.settings = settings
        self.identity: dict = {}
        self.fitted_on: dict = {}

    # ---- the parts' figures, read where a caller reports them ------------------------------------------------------
    @property
    def threshold(self) -> float | None:
        """The decision threshold on probabilities (:class:`OperatingPoint`)."""
        return self.operating.threshold

    @property
    def calibrator(self):
        return self.operating.calibrator

    @property
    def decision_rule(self) -> str:
        return self.operating.decision

    @property
    def prior(self) -> float | None:
        return self.operating.prior

    @property
    def min_span_confidence(self) -> float:
        """Spans below this confidence are left out of verdicts (:class:`SpanRule`)."""
        return self.span.min_confidence

    @min_span_confidence.setter
    def min_span_confidence(self, value: float) -> None:
        from halwatch.detectors.spans import check_confidence

        self.span.min_confidence = check_confidence(value)

    @property
    def ood_reference(self) -> dict | None:
        return None if self.reference is None else self.reference.to_dict()

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

    def own_threshold(self) -> float | None:
        """A method's own decision threshold on the fitted probabilities, where it has one (a classifier's decision
        value, LRP4RAG's), in place of the operating point's decision rule; ``None`` by default."""
        return None

    def fold_copy(self) -> "Detector":
        """An unfitted copy for one fold of the out-of-fold calibration: the same settings, with any
        hyper-parameter that the fit on the whole probe chose (e.g. a regularisation strength) fixed."""
        return type(self)(scorer=self.scorer, calibration=self.calibrator.method, decision=self.decision_rule,
                          prior=self.prior, **self.settings)

    def fit_parts(self, signals: list[Signals], labels: np.ndarray, views: list[TokenView] | None,
                  groups=None) -> None:
        """The method's own fitting: :meth:`fit_method`, then :meth:`fit_spans` where there are gold spans."""
        self.fit_method(signals, labels)
        if views is not None:
            self.fit_spans(signals, views)

    def fit_out_of_fold(self, signals: list[Signals], labels: np.ndarray, views: list[TokenView] | None,
                        groups=None) -> crossfit.OutOfFold:
        """Fit the method on the whole probe and return its out-of-fold scores of it (:mod:`.crossfit`): by
        default :meth:`fit_parts`, then copies fitted without each fold (:func:`crossfit.by_copies`); an
        unsupervised method's own scores (in sample, no folds)."""
        self.fit_parts(signals, labels, views, groups)
        if not self.supervised:
            raw = np.asarray(self.raw_scores(signals), dtype=float)
            return crossfit.OutOfFold(raw, self.token_scores(signals), raw[:, None])
        return crossfit.by_copies(self, signals, labels, views, groups)

    def state(self) -> dict:
        return {}

    def set_state(self, state: dict) -> None:
        pass

    def ood_inputs(self, signals: list[Signals]) -> np.ndarray:
        """``[n, k]``: the inputs whose distance from the training data the verdicts report; by default the raw
        score (a method with several inputs to its last step reports those)."""
        return np.asarray(self.raw_scores(signals), dtype=float)[:, None]

    def outputs(self, signals: list[Signals]) -> tuple[np.ndarray, list | None, np.ndarray]:
        """``(raw scores, token scores or None, OOD inputs)`` of a batch: everything a verdict needs, computed in one
        go so that a method can share the work (the fused detector's answer score pools its token scores: its token
        model runs once). By default each comes from its own method; a method that overrides :meth:`ood_inputs`
        overrides this too."""
        raw = np.asarray(self.raw_scores(signals), dtype=float)
        return raw, self.token_scores(signals), raw[:, None]

    # ---- fitting ------------------------------------------------------------------------------------------------
    def get_scorer(self):
        """The scorer given at construction, else one made from the artifact's identity (or the defaults; warning,
        as a given one does, where its precision is not the fitted one's)."""
        if self.scorer is None:
            from halwatch.scorer import Scorer

            self.scorer = Scorer.from_options(identity=self.identity)
            if self.identity:
                warn_precision(self.name, self.identity, self.scorer)
        return self.scorer

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

    def fit_signals(self, signals: list[Signals], labels, views: list[TokenView] | None = None,
                    groups=None, scored=None) -> "Detector":
        """Fit on precomputed signals (the benchmark harness feeds many detectors from one pass this way):
        the method and its out-of-fold scores (:meth:`fit_out_of_fold`), then the operating point, the OOD
        reference and the span rule on them. ``groups``: the source of each answer, so that no fold parts one
        source's answers (default: the sources of the ``views``' samples). ``scored``: ``(views, signals)`` of the
        same answers as scoring sees them (:meth:`halwatch.scorer.Scorer.windowed`: a context longer than the token
        cap in its windows); the method is fitted on the one view of each answer, and the parts on the held-out
        scores of the answers as scored (:func:`crossfit.as_scored`), so that the operating point holds for answers
        scored in windows too (a supervised method; an unsupervised one's score is calibrated on the one view)."""
        labels = np.asarray(labels, dtype=int)
        if len(labels) != len(signals):
            raise ValueError(f"{len(signals)} samples but {len(labels)} labels")
        if len(np.unique(labels)) < 2:
            raise InputError("the probe data needs both hallucinated (1) and grounded (0) samples")
        groups = np.asarray(groups) if groups is not None else groups_of(views)
        strata = datasets_of(views)
        if views is not None and not any(v.sample.spans for v in views):
            views = None  # no gold spans: nothing span-level to fit
        held = self.fit_out_of_fold(signals, labels, views, groups)
        if held.folds:
            self.fit_held_out(held.folds, signals, views)
        windowed = 0
        if scored is not None and self.supervised:  # (an unsupervised score is calibrated as it is)
            held, windowed = crossfit.as_scored(held, scored)
        probs = self.operating.fit(held.raw, labels, oriented=self.supervised, strata=strata)
        own = self.own_threshold()
        if own is not None:
            self.operating.threshold = own
        self.reference = OODReference.fit(held.inputs, held_out_auroc(held.raw, labels, self.supervised))
        span_fit = None
        if held.tokens is not None:
            span_fit = self.span.fit(held.tokens, probs, labels, views, self.threshold)
        self._describe_fit(labels, groups, strata, probs, windowed, span_fit)
        return self

    def _describe_fit(self, labels, groups, strata, probs, windowed: int, span_fit) -> None:
        """``fitted_on`` and ``identity`` after a fit."""
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

    # ---- the operating point on a user's data -------------------------------------------------------------------
    def recalibrate(self, raw, labels, target_fpr: float | None = None, describe: str = "", tasks=None) -> dict:
        """Fit this detector's probabilities and decision threshold anew on a user's own labelled answers (the
        method itself is kept), given their raw scores as scoring computes them (:meth:`answer_outputs`, long
        contexts in windows): :meth:`OperatingPoint.recalibrate` (their share of hallucinated answers is the prior
        the probabilities then assume; with ``target_fpr``, the split-conformal threshold that holds that
        false-positive rate on answers like these, else the best F1 on them). Returns what was reached on these
        answers and the guarantee's terms. ``tasks`` (each answer's :func:`halwatch.sample.task_of`) matter only to
        a detector with one part per task."""
        self._require_fitted()
        report = self.operating.recalibrate(raw, labels, target_fpr, oriented=self.supervised)
        self.fitted_on = {**self.fitted_on, "recalibrated": {**report, "data": describe}}
        return report

    def assumed_prior(self) -> float:
        """The share of hallucinated answers this detector's probabilities assume (:class:`OperatingPoint`)."""
        return self.operating.assumed_prior(self.name)

    def restate_prior(self, prior: float | None = None, probs=None, describe: str = "", tasks=None) -> dict:
        """Let the probabilities assume another share of hallucinated answers, keeping every verdict and span: the
        share ``prior`` a user states, or the one estimated from ``probs``, the probabilities (as scoring gives
        them) of unlabelled answers like those to be judged (:meth:`OperatingPoint.restate`). Use it when the
        answers to be judged hold another share of hallucinated ones than the training answers (RAGTruth's official
        test split: 26 %, against 46 % in its training split); it assumes that this share is all that differs.
        ``tasks`` matter only to a detector with one part per task."""
        self._require_fitted()
        report = self.operating.restate(prior, probs, self.name)
        self.fitted_on = {**self.fitted_on, "restated": {**report, "data": describe}}
        return report

    def _require_fitted(self):
        if not self.operating.fitted:
            raise HalwatchError(f"detector {self.name!r} is not fitted: call fit() or load a fitted artifact")

    # ---- scoring ------------------------------------------------------------------------------------------------
    def score(self, samples: list[Sample], progress: bool = False) -> np.ndarray:
        """Probability of hallucination of each sample's response (a long context in windows, as scoring sees it)."""
        self._require_fitted()
        return self.answer_scores(*self._encoded(samples, progress))[1]

    def _encoded(self, samples: list[Sample], progress: bool = False) -> tuple[list[TokenView], list[Signals]]:
        """``(views, signals)`` of ``samples`` as ``halwatch score`` sees them: each in the windows of its long
        context (:meth:`halwatch.scorer.Scorer.encode_windows`)."""
        scorer = self.get_scorer()
        views = [v for found in scorer.encode_many(samples) for v in found]
        return views, scorer.signals([v.sample for v in views], self.request(), progress=progress, views=views)

    def scores_and_ranking(self, signals: list[Signals]) -> tuple[np.ndarray, np.ndarray]:
        """``(probabilities, ranking)`` of answers each in one view (no windows): the calibrated probabilities, and
        the score that ranks answers in the benchmark (the raw score, turned the way the calibration runs; see
        :meth:`Calibrator.ranking`)."""
        self._require_fitted()
        raw = np.asarray(self.raw_scores(signals), dtype=float)
        return self.operating.probabilities(raw), self.operating.ranking(raw)

    def answers(self, samples: list[Sample], progress: bool = False
                ) -> tuple[list[TokenView], np.ndarray, list | None, np.ndarray]:
        """:meth:`answer_outputs` of ``samples``, one answer per sample."""
        return self.answer_outputs(*self._encoded(samples, progress))

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
        return (views, self.operating.probabilities(raw), self.operating.ranking(raw),
                np.full(len(views), float(self.threshold)), tokens)

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
        ranking = self.operating.ranking(raw)
        picks = [g[int(np.argmin(ranking[g]))] for g in groups]
        if tokens is not None:
            tokens = [np.min(np.stack([np.asarray(tokens[i], dtype=float) for i in g]), axis=0) for g in groups]
        return [views[g[-1]] for g in groups], raw[picks], tokens, inputs[picks]

    def token_spans(self, view: TokenView, tokens, prob: float, min_confidence: float | None = None) -> list[dict]:
        """The flagged word spans of one response under the span rule, given its token scores (``None``: the
        method has none) and probability: :meth:`SpanRule.spans` on the scale the rule was fitted on (before any
        restated prior)."""
        fitted = self.operating.as_fitted
        return self.span.spans(view, tokens, float(fitted(prob)), float(fitted(self.threshold)), min_confidence)

    def verdicts(self, views: list[TokenView], signals: list[Signals],
                 min_span_confidence: float | None = None, sentences: bool = False) -> list[dict]:
        """What ``halwatch score`` and the service report for each response (the fields of
        :class:`halwatch.result.Result`): ``id``, ``score`` (probability of hallucination), ``hallucinated`` (score
        >= ``threshold``), ``threshold``, ``spans`` (character offsets into the response, Python string indices =
        Unicode code points, with the text and a confidence; those below ``min_span_confidence`` left out, by
        default the span rule's), the detector, scoring model and input mode, ``truncated`` (context tokens cut to
        fit the token cap; the response is never cut), ``windows`` (how many windows of a long context the answer
        was scored against: consecutive ``views`` of one answer's windows give one verdict) and ``ood``. The batch's
        scores, token scores and OOD inputs are computed once (:meth:`outputs`). With ``sentences``, each verdict's
        ``evidence`` lists the response's sentences (:func:`halwatch.sentences.sentence_ranges`) with their
        ``support``: one less their chance of holding unsupported words (:meth:`SpanRule.sentence_chances`)."""
        self._require_fitted()
        views, raw, tokens, ood_inputs = self.answer_outputs(views, signals)
        probs = self.operating.probabilities(raw)
        ood = self.reference.of(ood_inputs) if self.reference is not None else [None] * len(views)
        tokens = tokens if tokens is not None else [None] * len(views)
        model = self.identity.get("scoring_model") or self.get_scorer().model.name
        found = [{"id": view.sample.id, "score": round(float(p), 4), "hallucinated": bool(p >= self.threshold),
                  "threshold": round(float(self.threshold), 4),
                  "spans": self.token_spans(view, t, float(p), min_span_confidence),
                  "detector": self.name, "scoring_model": model, "input_mode": view.input_mode,
                  "truncated": view.cut_tokens, "windows": view.window[1], **({"ood": far} if far is not None else {})}
                 for view, t, p, far in zip(views, tokens, probs, ood)]
        for verdict, view, t, p in zip(found, views, tokens, probs) if sentences else ():
            verdict["evidence"] = self.sentence_support(view, t, float(p))
        return found

    def sentence_support(self, view: TokenView, tokens, prob: float) -> list[dict]:
        """The response's sentences (``start``, ``end``, ``text``) with their ``support`` (see :meth:`verdicts`),
        on the scale the span rule was fitted on, as :meth:`token_spans` reads it."""
        text = view.sample.response
        ranges = sentence_ranges(text)
        fitted = self.operating.as_fitted
        chances = self.span.sentence_chances(view, tokens, float(fitted(prob)), float(fitted(self.threshold)), ranges)
        return [{"start": a, "end": b, "text": text[a:b], "support": round(1.0 - float(c), 4)}
                for (a, b), c in zip(ranges, chances)]

    # ---- artifacts ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        self._require_fitted()
        return {"format": ARTIFACT_FORMAT, "detector": self.name, "citation": self.citation, **self.identity,
                "settings": self.settings, **self.operating.to_dict(), **self.span.to_dict(), "state": self.state(),
                "ood_reference": self.ood_reference, "fitted_on": self.fitted_on}

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
        det.fitted_on = d.get("fitted_on", {})
        det.operating = OperatingPoint.from_dict(d, det.fitted_on)
        det.span = SpanRule.from_dict(d)
        det.reference = OODReference.from_dict(d.get("ood_reference"))
        det.identity = {k: d[k] for k in ("scoring_model", "weights_sha256", "input_mode", "max_tokens", "dtype",
                                          "signal_versions") if k in d}
        stale = {name: v for name, v in det.identity.get("signal_versions", {}).items()
                 if reducers.REDUCERS.get(name) is None or reducers.REDUCERS[name].version != v}
        if stale:
            now = reducers.versions([name for name in stale if name in reducers.REDUCERS])
            raise HalwatchError(f"detector {d['detector']!r} was fitted on older definitions of the signals {stale} "
                                f"(this halwatch computes {now}): fit it again (`halwatch fit`)")
        det.set_state(d.get("state", {}))
        if scorer is not None and det.identity:
            check_scorer(d["detector"], det.identity, scorer)
            if precision_warning:
                warn_precision(d["detector"], det.identity, scorer)
        return det


def check_scorer(name: str, identity: dict, scorer) -> None:
    """Refuse a scorer of another input mode or scoring model than an artifact's ``identity`` (the mode first: its
    refusal comes before the model loads)."""
    for key in ("input_mode", "weights_sha256"):
        mine = scorer.input_mode if key == "input_mode" else scorer.identity()[key]
        if mine != identity[key]:
            raise HalwatchError(f"detector was fitted with {key}={identity[key]} ({identity['scoring_model']}), "
                                f"but the scorer has {key}={mine}: fit it again for this setting (`halwatch fit`)")
