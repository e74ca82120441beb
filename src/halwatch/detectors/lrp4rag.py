"""LRP4RAG (Hu, Sun and Zhang 2024): the relevance of the prompt for the response, propagated through the scoring
model (section 3.2, :mod:`halwatch.models.relevance`), resampled to a fixed length (eq. 7-9) and classified
(section 3.4), or thresholded (section 4.4.2)."""

from __future__ import annotations

import numpy as np

from halwatch.detectors import classifiers
from halwatch.detectors.base import Detector
from halwatch.models.relevance import METHODS, TARGETS, RelevanceRequest
from halwatch.models.signal_types import SignalRequest
from halwatch.signals.relevance import normalise, resample

FEATURES = ("response", "prompt", "both")
CHOICES = (*classifiers.CLASSIFIERS, "threshold")
#: ``minmax``: each relevance vector to [0, 1) before resampling (sections 4.2 and 4.4); ``none``: raw relevance.
NORMALIZE = ("minmax", "none")


def prompt_relevance(sig) -> np.ndarray:
    """``R^prompt`` (eq. 5): the relevance of each prompt token, averaged over the response tokens."""
    return sig.relevance["mean"][: sig.n_prompt].astype(float)


def response_relevance(sig) -> np.ndarray:
    """``R^response`` (eq. 6): the mean relevance of the prompt tokens for each response token."""
    return sig.relevance["response"].astype(float)


class LRP4RAG(Detector):
    """Hallucination from low prompt-to-response relevance.

    Settings: ``method`` (``lrp``, AttnLRP's rules; ``lrp-cp``, attention weights constant; or ``ixg``, Input x
    Gradient), ``target`` (the logit explained at each response position: ``max``, the largest logit, the default as
    in the paper, section 3.2: "First, the maximum logit is selected as the relevance value for the last layer",
    shared/papers/lrp4rag.md line 82; or ``token``, the logit of the response's own token), ``normalize`` (below),
    ``classifier`` (``svm`` with an RBF kernel, ``mlp``, ``random_forest``, ``lstm``, or ``threshold``),
    ``features`` (``response`` = ``R^response``, ``prompt`` = ``R^prompt``, or ``both`` concatenated), ``length``
    (``L_new`` of eq. 7, 220 as in Table 3), ``rows`` (response steps of ``R*`` for the LSTM, each one backward
    pass), ``epochs`` (LSTM training) and ``seed``.

    ``normalize``: ``minmax`` (the default) maps each answer's relevance to [0, 1) with
    :func:`halwatch.signals.relevance.normalise`, ``(R - min R) / (max R - min R + 1e-6)``: the paper normalises
    relevance "to the interval (0, 1)" (section 4.4, line 166) with "epsilon 1e-6 when normalizing the relevance
    scores" (section 4.2, line 150), and searches its thresholds in (0, 1) (section 4.4.2, line 208). It applies to
    each answer's ``R^response`` and ``R^prompt`` separately (for ``both``, before they are concatenated), with the
    min and max of the vector itself, before the resampling to ``length`` (eq. 7-9); for the LSTM, to the pass's
    ``rows x n_prompt`` matrix (``R*`` already resampled along the response, each row one seed) as a whole, before
    it is resampled along the prompt. Section 4.4 describes the normalisation for its figures (curves averaged over
    answers); normalising each answer's features is our reading of it for the classifiers. ``none`` keeps the raw
    relevance (the behaviour before this setting, and of artifacts saved without it). Token scores (spans) are
    always the raw ``-R^response``.

    The classifiers see the resampled vectors (the LSTM the ``rows x length`` resampled ``R*``, response steps as
    time, section 3.4); their score of "hallucinated" is the raw score, calibrated on out-of-fold scores of the probe
    data, and their own decision boundary is the threshold. ``threshold`` is section 4.4.2: the mean of the feature
    resampled to 100 values, lower = more likely hallucinated, with the threshold of best F1 on the probe data.
    Token scores are ``-R^response`` (a response token that draws little on the prompt), thresholded on the probe
    data for spans.
    """

    name = "lrp4rag"
    citation = "Hu, Sun and Zhang 2024, LRP4RAG (sections 3.2-3.4, 4.4.2)"

    def __init__(self, scorer=None, calibration: str = "platt", method: str = "lrp", target: str = "max",
                 normalize: str = "minmax", classifier: str = "svm", features: str = "response", length: int = 220,
                 rows: int = 16, epochs: int = 30, seed: int = 0, **settings):
        if method not in METHODS or target not in TARGETS:
            raise ValueError(f"method must be one of {METHODS} and target one of {TARGETS}")
        if normalize not in NORMALIZE:
            raise ValueError(f"unknown normalize {normalize!r}: choose one of {', '.join(NORMALIZE)}")
        if classifier not in CHOICES:
            raise ValueError(f"unknown classifier {classifier!r}: choose one of {', '.join(CHOICES)}")
        if features not in FEATURES:
            raise ValueError(f"unknown features {features!r}: choose one of {', '.join(FEATURES)}")
        if int(length) < 1 or int(rows) < 1:
            raise ValueError(f"length and rows must be positive, got {length} and {rows}")
        super().__init__(scorer=scorer, calibration=calibration, method=method, target=target, normalize=normalize,
                         classifier=classifier, features=features, length=int(length), rows=int(rows),
                         epochs=int(epochs), seed=int(seed), **settings)
        self.model: dict = {}

    def request(self):
        s = self.settings
        rows = s["rows"] if s["classifier"] == "lstm" else 0
        return SignalRequest(relevance=RelevanceRequest(method=s["method"], target=s["target"], rows=rows))

    def _normalised(self, values) -> np.ndarray:
        """``values`` as the ``normalize`` setting has them: min-max to [0, 1) with epsilon 1e-6, or raw."""
        return normalise(values) if self.settings["normalize"] == "minmax" else np.asarray(values, dtype=float)

    def features(self, signals) -> np.ndarray:
        """The classifier's input: ``[n, length]`` (``[n, 2 length]`` for ``both``), or ``[n, rows, length]``
        for the LSTM; each vector normalised (``normalize``), then resampled (eq. 7-9)."""
        s = self.settings
        if s["classifier"] == "lstm":
            from halwatch.signals.relevance import resample_2d

            return np.stack([resample_2d(self._normalised(sig.relevance["rows"]), s["rows"], s["length"])
                             for sig in signals])
        length = 100 if s["classifier"] == "threshold" else s["length"]
        parts = []
        if s["features"] in ("response", "both"):
            parts.append(np.stack([resample(self._normalised(response_relevance(sig)), length) for sig in signals]))
        if s["features"] in ("prompt", "both"):
            parts.append(np.stack([resample(self._normalised(prompt_relevance(sig)), length) for sig in signals]))
        return np.concatenate(parts, axis=1)

    @property
    def supervised(self) -> bool:
        """The classifiers learn from labels (so they are calibrated out of fold, :mod:`halwatch.detectors.base`:
        a random forest separates its own training data perfectly); the threshold method does not."""
        return self.settings["classifier"] != "threshold"

    def fit_method(self, signals, labels):
        if self.settings["classifier"] == "threshold":
            return
        self.model = self._fit_classifier(self.features(signals), labels)

    def _fit_classifier(self, x, labels) -> dict:
        s = self.settings
        extra = {"epochs": s["epochs"]} if s["classifier"] == "lstm" else {}
        return classifiers.fit(s["classifier"], x, labels, seed=s["seed"], **extra)

    def own_threshold(self):
        """The classifier's own decision (SVM decision value 0, probability 0.5 for the others), as the paper's
        predictions are; the threshold method searches the probe data for the best F1 (section 4.4.2: the decision
        rule's)."""
        kind = self.settings["classifier"]
        if kind == "threshold":
            return None
        return float(self.calibrator.transform(np.array([0.0 if kind == "svm" else 0.5]))[0])

    def raw_scores(self, signals):
        x = self.features(signals)
        if self.settings["classifier"] == "threshold":
            return -x.mean(axis=1)
        return classifiers.predict(self.model, x)

    def token_scores(self, signals):
        return [-response_relevance(sig) for sig in signals]

    def state(self):
        return {"model": self.model}

    @classmethod
    def from_dict(cls, d: dict, scorer=None, precision_warning: bool = True) -> "LRP4RAG":
        """An artifact saved before the ``normalize`` setting existed was fitted on raw relevance: it loads with
        ``normalize=none`` (its ``target`` was always saved)."""
        settings = d.get("settings", {})
        if "normalize" not in settings:
            d = {**d, "settings": {**settings, "normalize": "none"}}
        return super().from_dict(d, scorer=scorer, precision_warning=precision_warning)

    def set_state(self, state):
        self.model = state.get("model", {})


def relevance_matrix(scorer, sample, method: str = "lrp", target: str = "token") -> dict:
    """The whole relevance matrix ``R*`` of one answer (section 3.2; one backward pass per response token):
    ``{"matrix": [R, n_prompt], "prompt_tokens": [...], "response_tokens": [...], "logits": [R]}``, raw (not
    normalised). ``target`` is ``token`` here, the answer's own tokens, to read which prompt words each of them draws
    on; the detector explains the maximum logit by default, as the paper does (``target="max"``)."""
    view = scorer.encode(sample)
    request = SignalRequest(relevance=RelevanceRequest(method=method, target=target, rows=-1))
    sig = scorer.signals([sample], request, views=[view])[0]
    tokens = scorer.model.tokenizer.convert_ids_to_tokens(view.input_ids)
    text = [scorer.model.tokenizer.convert_tokens_to_string([t]) for t in tokens]
    return {"matrix": sig.relevance["rows"], "prompt_tokens": text[: view.n_prompt],
            "response_tokens": text[view.n_prompt :], "logits": sig.relevance["logits"]}
