"""Attention-based detectors besides TOHA: Lookback Lens, the attention-ratio baseline and LLM-Check's attention
score. All read per-head reducer outputs of the forward pass (``lookback.ratio``, ``diag.w``)."""

from __future__ import annotations

import numpy as np

from halwatch.detectors import linear
from halwatch.detectors.base import Detector
from halwatch.detectors.calibration import best_f1_threshold
from halwatch.detectors.heads import select_heads
from halwatch.models.signal_types import SignalRequest
from halwatch.signals.lookback import window_means


def _all_heads(detector):
    return detector.get_scorer().model.all_heads()


def mean_lookback(signals, heads) -> np.ndarray:
    """Response-level lookback feature: the time mean of each head's lookback ratio, ``[N, len(heads)]``."""
    return np.stack([s.head_values("lookback.ratio", heads).mean(axis=1) for s in signals])


class LookbackLens(Detector):
    """Lookback Lens (Chuang et al. 2024, section 2): the time-mean lookback ratio of every head, concatenated over
    layers and heads, standardised, into a logistic regression (max_iter 1000). Label 1 = hallucinated (the
    reference code's label 1 meant "not hallucinated"; here the classifier predicts hallucination directly).
    The raw score is the classifier's log-odds. The lookback ratio of step ``i`` is that of the query before
    ``y_i``, with the answer header counted as new tokens, as in the reference code
    (:mod:`halwatch.signals.lookback`).

    Departure: the paper fits scikit-learn's default regularisation (C = 1); here ``C="cv"`` (the default) chooses
    it by cross-validated log-loss on the probe, since 270 features face 100-2,500 answers. The calibration and
    both thresholds (answer and window) are fitted out of fold (:mod:`halwatch.detectors.base`).

    Span level (section 2.2): when the probe data has gold spans, a second logistic regression is fitted on the
    lookback ratios averaged over sliding windows of ``window`` response tokens (``window_stride`` apart), a window
    being hallucinated when it overlaps a gold span. A token's score is then the mean probability of the windows
    (every start, stride 1) that cover it, and spans are the runs of tokens above the token threshold. Without gold
    spans the token score is ``1 -`` the mean lookback ratio over heads. The window classifier also scores a
    candidate chunk in guided decoding (section 3, :meth:`continuation_scores`)."""

    name = "lookback-lens"
    citation = "Chuang et al., EMNLP 2024 (arXiv:2407.07071)"
    supervised = True

    def __init__(self, scorer=None, calibration: str = "platt", C: float | str = "cv", window: int = 8,
                 window_stride: int = 4, **settings):
        super().__init__(scorer=scorer, calibration=calibration, C=C, window=window, window_stride=window_stride,
                         **settings)
        self.model: dict = {}
        self.window_model: dict | None = None
        self.window_threshold: float | None = None
        self.feature_map: dict | None = None  # set by mapped_from (cross-model transfer)
        self.window_C: float | str = C  # the window classifier's regularisation (a fold copy's is fixed)

    def request(self):
        return SignalRequest(heads=_all_heads(self), reducers=("lookback",))

    def _features(self, x) -> np.ndarray:
        """Per-head features of this scoring model, mapped into the source model's heads for a transferred
        detector (section 4, cross-model transfer)."""
        x = np.asarray(x, dtype=float)
        if self.feature_map is None:
            return x
        return x @ np.array(self.feature_map["coef"]) + np.array(self.feature_map["intercept"])

    def fit_method(self, signals, labels):
        self.feature_map = None  # fitted again on this model's own heads: no longer a mapped detector
        self.model = linear.fit(mean_lookback(signals, _all_heads(self)), labels, C=self.settings["C"])

    def fold_copy(self):
        """A fold's copy uses the regularisation strengths chosen on the whole probe."""
        copy = super().fold_copy()
        copy.settings["C"] = self.model["C"]
        copy.window_C = self.window_model["C"] if self.window_model else self.window_C
        return copy

    def raw_scores(self, signals):
        return linear.logodds(self.model, self._features(mean_lookback(signals, _all_heads(self))))

    def _windows(self, sig, stride=None):
        ratio = sig.head_values("lookback.ratio", _all_heads(self))
        starts, x = window_means(ratio, self.settings["window"], stride or self.settings["window_stride"])
        return starts, self._features(x)

    @classmethod
    def mapped_from(cls, source: "LookbackLens", scorer, samples, alpha: float = 1.0,
                    progress: bool = False) -> "LookbackLens":
        """Cross-model transfer (Lookback Lens section 4): a linear regression maps this ``scorer``'s per-head
        features to the heads of the fitted ``source`` detector's model, fitted on both models' time-mean lookback
        ratios of the same (unlabelled) ``samples``; the source's classifiers, calibration and thresholds are then
        used unchanged, so no labels of the new model are needed. Ridge regression (``alpha``) on standardised
        features, because a model may have more heads than there are samples."""
        from sklearn.linear_model import Ridge

        source._require_fitted()
        target = cls(scorer=scorer, **source.settings)
        x_source = mean_lookback(source.get_scorer().signals(samples, source.request(), progress=progress),
                                 _all_heads(source))
        x_target = mean_lookback(target.get_scorer().signals(samples, target.request(), progress=progress),
                                 _all_heads(target))
        mean, std = x_target.mean(axis=0), x_target.std(axis=0) + 1e-8
        ridge = Ridge(alpha=alpha).fit((x_target - mean) / std, x_source)
        coef = ridge.coef_.T / std[:, None]  # [target heads, source heads] on raw features
        target.feature_map = {"coef": coef.tolist(), "intercept": (ridge.intercept_ - mean @ coef).tolist(),
                              "source_model": source.identity.get("scoring_model"), "n_samples": len(samples),
                              "alpha": alpha}
        target.model, target.window_model = source.model, source.window_model
        target.window_threshold = source.window_threshold
        target.operating.calibrator, target.operating.threshold = source.calibrator, source.threshold
        target.span.threshold, target.span.rule = source.span.threshold, dict(source.span.rule)
        target.identity = scorer.identity()
        target.fitted_on = {**source.fitted_on, "mapped_from": source.identity.get("scoring_model"),
                            "map_samples": len(samples)}
        return target

    def window_data(self, signals, views, groups: bool = False):
        """Features ``[W, heads]`` and labels ``[W]`` of the sliding windows of every response: a window is
        hallucinated (1) when one of its tokens overlaps a gold span; responses labelled hallucinated without gold
        spans are left out. With ``groups``, also the source of the response of each window."""
        feats, labels, owner = [], [], []
        for sig, view in zip(signals, views):
            if not view.has_token_labels:
                continue
            starts, x = self._windows(sig)
            tokens = view.token_labels()
            feats.append(x)
            labels += [int(tokens[s:s + self.settings["window"]].any()) for s in starts]
            owner += [view.sample.source] * len(starts)
        out = (np.concatenate(feats), np.array(labels))
        return (*out, np.array(owner)) if groups else out

    def fit_spans(self, signals, views):
        x, y, owner = self.window_data(signals, views, groups=True)
        self.window_model = None
        if len(np.unique(y)) < 2:
            return
        self.window_model = linear.fit(x, y, C=self.window_C, groups=owner, folds=3)

    def fit_held_out(self, folds, signals, views):
        """The window threshold: best F1 over the windows of each fold, scored by the copy fitted without it."""
        self.window_threshold = None
        if self.window_model is None or any(copy.window_model is None for copy, _ in folds):
            return
        probs, labels = [], []
        for copy, held in folds:
            x, y = self.window_data([signals[i] for i in held], [views[i] for i in held])
            probs.append(copy.window_probabilities(x))
            labels.append(y)
        self.window_threshold = best_f1_threshold(np.concatenate(probs), np.concatenate(labels))

    def window_logodds(self, features) -> np.ndarray:
        return linear.logodds(self.window_model, features)

    def window_probabilities(self, features) -> np.ndarray:
        from halwatch.detectors.logistic import sigmoid

        return sigmoid(self.window_logodds(features))

    def token_scores(self, signals):
        heads = _all_heads(self)
        if self.window_model is None:
            return [1.0 - s.head_values("lookback.ratio", heads).mean(axis=0).astype(float) for s in signals]
        out = []
        for sig in signals:
            starts, x = self._windows(sig, stride=1)
            probs = self.window_probabilities(x)
            total, count = np.zeros(sig.n_response), np.zeros(sig.n_response)
            for s, p in zip(starts, probs):
                total[s:s + self.settings["window"]] += p
                count[s:s + self.settings["window"]] += 1
            out.append(total / np.maximum(count, 1))
        return out

    def continuation_scores(self, signals, start: int) -> np.ndarray:
        """Guided decoding (section 3): the window classifier on the lookback ratios of the candidate chunk
        (response tokens from ``start``; the last token for a candidate that only ends the answer); the
        response-level classifier when no window classifier was fitted."""
        if self.window_model is None:
            return self.raw_scores(signals)
        heads = _all_heads(self)
        x = np.stack([s.head_values("lookback.ratio", heads)[:, min(start, s.n_response - 1):].mean(axis=1)
                      for s in signals])
        return self.window_logodds(self._features(x))

    def state(self):
        return {"model": self.model, "window_model": self.window_model, "window_threshold": self.window_threshold,
                "feature_map": self.feature_map}

    def set_state(self, state):
        self.model = state["model"]
        self.window_model = state.get("window_model")
        self.window_threshold = state.get("window_threshold")
        self.feature_map = state.get("feature_map")


class AttentionRatio(Detector):
    """Attention-ratio baseline of TOHA (Table 10): the Lookback Lens feature (``1 -`` time-mean lookback ratio, so
    that larger means less attention on the context) with TOHA's head selection (Algorithm 1) instead of a
    classifier."""

    name = "attention-ratio"
    citation = "Bazarova et al., TOHA, Table 10 (features of Chuang et al. 2024)"
    supervised = True

    def __init__(self, scorer=None, calibration: str = "platt", n_max: int = 10, **settings):
        super().__init__(scorer=scorer, calibration=calibration, n_max=n_max, **settings)
        self.heads: list[tuple[int, int]] | None = None

    def request(self):
        heads = self.heads if self.heads is not None else _all_heads(self)
        return SignalRequest(heads=tuple(map(tuple, heads)), reducers=("lookback",))

    def fit_request(self):
        return SignalRequest(heads=_all_heads(self), reducers=("lookback",))

    def fit_method(self, signals, labels):
        heads = _all_heads(self)
        order, _, n_opt = select_heads(1.0 - mean_lookback(signals, heads), labels, self.settings["n_max"])
        self.heads = [heads[i] for i in order[:n_opt]]

    def raw_scores(self, signals):
        return (1.0 - mean_lookback(signals, self.heads)).mean(axis=1)

    def state(self):
        return {"heads": [list(h) for h in self.heads]}

    def set_state(self, state):
        self.heads = [tuple(h) for h in state["heads"]]


class LLMCheckAttention(Detector):
    """LLM-Check attention score (Sriramanan et al., NeurIPS 2024): the log-determinant of a head's (lower
    triangular) attention kernel is the sum of the log of its diagonal; averaged here over tokens and over all
    heads of all layers. Only response rows are captured, so the diagonal is that of the response tokens (the
    original also includes the prompt's). Its orientation is fitted with the calibration on probe data."""

    name = "llm-check"
    citation = "Sriramanan et al., NeurIPS 2024 (LLM-Check), attention score"

    def request(self):
        return SignalRequest(heads=_all_heads(self), reducers=("diag",))

    def raw_scores(self, signals):
        heads = _all_heads(self)
        return np.array([float(np.log(np.clip(s.head_values("diag.w", heads), 1e-12, None)).mean())
                         for s in signals])
