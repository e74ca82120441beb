"""The detector contract shared by every method.

A detector declares the signals it needs (:meth:`Detector.request`), so that one forward pass can feed many
detectors, and turns them into a raw score per response (higher = more likely hallucinated) and, where it can, a
score per response token. ``fit`` runs any supervised step of the method, then fits the calibration to
probabilities and the decision threshold (best F1) on the probe data, and the token threshold used for spans.
Nothing is hard-coded: an unfitted detector refuses to score.

Artifacts are small JSON files that record the detector, its settings and fitted state, the scoring model (name
and weights hash), the input mode and the token cap, and what it was fitted on.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from pathlib import Path
from typing import ClassVar

import numpy as np

from halwatch.detectors.calibration import Calibrator, best_f1_threshold
from halwatch.errors import HalwatchError, InputError
from halwatch.models.forward import Signals, SignalRequest
from halwatch.sample import Sample
from halwatch.models.registry import DEFAULT_MODEL
from halwatch.tokens import DEFAULT_MAX_TOKENS, TokenView

ARTIFACT_FORMAT = "halwatch-detector/1"


class Detector:
    """Base class: subclasses set ``name`` and ``citation`` and implement ``request`` and ``raw_scores``
    (and optionally ``token_scores``, ``fit_method``, ``state``/``set_state``)."""

    name: ClassVar[str] = ""
    citation: ClassVar[str] = ""

    def __init__(self, scorer=None, calibration: str = "platt", **settings):
        self.scorer = scorer
        self.settings = settings
        self.calibrator = Calibrator(calibration)
        self.threshold: float | None = None
        self.token_threshold: float | None = None
        self.identity: dict = {}
        self.fitted_on: dict = {}

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
        raise NotImplementedError

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

    def calibration_scores(self, signals: list[Signals], labels: np.ndarray) -> np.ndarray:
        """Raw scores of the probe data that the calibration is fitted on: by default the fitted method's own."""
        return self.raw_scores(signals)

    def decision_threshold(self, probs: np.ndarray, labels: np.ndarray) -> float:
        """The decision threshold on calibrated probabilities: by default the best F1 on the probe data."""
        return best_f1_threshold(probs, labels)

    def state(self) -> dict:
        return {}

    def set_state(self, state: dict) -> None:
        pass

    # ---- the contract ---------------------------------------------------------------------------------------------
    def _scorer(self):
        """The scorer given at construction, else one made from the artifact's identity (or the defaults)."""
        if self.scorer is None:
            from halwatch.scorer import Scorer

            ident = self.identity
            self.scorer = Scorer(model=ident.get("scoring_model", DEFAULT_MODEL),
                                 input_mode=ident.get("input_mode", "raw"),
                                 max_tokens=ident.get("max_tokens", DEFAULT_MAX_TOKENS))
        return self.scorer

    def _signals(self, samples, progress=False, views=None):
        return self._scorer().signals(samples, self.request(), progress=progress, views=views)

    def fit_signals(self, signals: list[Signals], labels, views: list[TokenView] | None = None) -> "Detector":
        """Fit on precomputed signals (the benchmark harness feeds many detectors from one pass this way)."""
        labels = np.asarray(labels, dtype=int)
        if len(labels) != len(signals):
            raise ValueError(f"{len(signals)} samples but {len(labels)} labels")
        if len(np.unique(labels)) < 2:
            raise InputError("the probe data needs both hallucinated (1) and grounded (0) samples")
        self.fit_method(signals, labels)
        if views is not None and any(v.sample.spans for v in views):
            self.fit_spans(signals, views)
        raw = self.calibration_scores(signals, labels)
        self.calibrator.fit(raw, labels)
        self.threshold = self.decision_threshold(self.calibrator.transform(raw), labels)
        tokens = self.token_scores(signals)
        if tokens is not None:
            self.token_threshold = self._fit_token_threshold(tokens, labels, views)
        self.fitted_on = {"n": int(len(labels)), "n_hallucinated": int(labels.sum())}
        if self.scorer is not None:
            self.identity = self.scorer.identity()
        return self

    def _fit_token_threshold(self, tokens, labels, views) -> float:
        """Best token-level F1 against gold spans where the probe data has them; otherwise the 95th percentile
        of token scores in grounded probe responses (a token is flagged when it is rarer than that in grounded
        answers)."""
        if views is not None and any(v.sample.spans for v in views):
            y = np.concatenate([v.token_labels() for v in views])
            return best_f1_threshold(np.concatenate(tokens), y)
        grounded = [t for t, label in zip(tokens, labels) if label == 0]
        return float(np.quantile(np.concatenate(grounded), 0.95))

    def fit(self, samples: list[Sample], labels=None, progress: bool = False) -> "Detector":
        """Fit on labelled samples (``labels`` default to each sample's ``label``)."""
        if labels is None:
            if any(s.label is None for s in samples):
                missing = next(s for s in samples if s.label is None)
                raise InputError("sample has no label; fitting needs a label on every sample", missing.where)
            labels = [s.label for s in samples]
        views = [self._scorer().encode(s) for s in samples]
        return self.fit_signals(self._signals(samples, progress, views), labels, views)

    def _require_fitted(self):
        if self.threshold is None:
            raise HalwatchError(f"detector {self.name!r} is not fitted: call fit() or load a fitted artifact")

    def score_signals(self, signals: list[Signals]) -> np.ndarray:
        self._require_fitted()
        return self.calibrator.transform(self.raw_scores(signals))

    def score(self, samples: list[Sample], progress: bool = False) -> np.ndarray:
        """Probability of hallucination of each sample's response."""
        self._require_fitted()
        return self.score_signals(self._signals(samples, progress))

    def predict(self, samples: list[Sample]) -> np.ndarray:
        return self.score(samples) >= self.threshold

    def spans_from(self, view: TokenView, signals: Signals) -> list[dict]:
        self._require_fitted()
        tokens = self.token_scores([signals])
        if tokens is None or self.token_threshold is None:
            return []
        return view.spans(tokens[0], self.token_threshold)

    def spans(self, sample: Sample) -> list[dict]:
        """Character spans of ``sample.response`` that the detector flags: ``[{start, end, text, confidence}]``."""
        view = self._scorer().encode(sample)
        return self.spans_from(view, self._signals([sample], views=[view])[0])

    # ---- artifacts ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        self._require_fitted()
        return {
            "format": ARTIFACT_FORMAT,
            "detector": self.name,
            "citation": self.citation,
            **self.identity,
            "settings": self.settings,
            "calibration": self.calibrator.to_dict(),
            "threshold": self.threshold,
            "token_threshold": self.token_threshold,
            "state": self.state(),
            "fitted_on": self.fitted_on,
        }

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")
        os.replace(tmp, path)

    @classmethod
    def from_dict(cls, d: dict, scorer=None) -> "Detector":
        det = cls(scorer=scorer, calibration=d["calibration"]["method"], **d.get("settings", {}))
        det.calibrator = Calibrator.from_dict(d["calibration"])
        det.threshold = d["threshold"]
        det.token_threshold = d.get("token_threshold")
        det.identity = {k: d[k] for k in ("scoring_model", "weights_sha256", "input_mode", "max_tokens") if k in d}
        det.fitted_on = d.get("fitted_on", {})
        det.set_state(d.get("state", {}))
        if scorer is not None and det.identity:
            mine = scorer.identity()
            for key in ("weights_sha256", "input_mode"):
                if mine[key] != det.identity[key]:
                    raise HalwatchError(
                        f"detector was fitted with {key}={det.identity[key]} ({det.identity['scoring_model']}), "
                        f"but the scorer has {key}={mine[key]}: fit it again for this setting (`halwatch fit`)"
                    )
        return det
