"""The adapter detector: the scoring model's own upper layers fine-tuned with LoRA and a token head on human span
labels (:mod:`halwatch.models.adapter`), read from the pass already run.

Each response token's score is the adapter's probability that it is hallucinated; the answer's raw score is the
highest token log-odds (hallucinations are short: a mean dilutes them). Fitting (:mod:`.adapter_fit`) captures the
training answers' inputs once, trains one adapter per source-grouped fold on the other folds, whose held-out token
scores are the out-of-fold scores the calibration, the threshold and the span rule are fitted on (as every
supervised detector's are, :mod:`halwatch.detectors.crossfit`), and one adapter on every answer, the one that ships.
The folds' adapters stay in the fit's work folder (``fitted_on["work"]``), so that a stack fitted on the same answers
can read its out-of-fold inputs from them (:meth:`Adapter.fold_plan`, :meth:`Adapter.fold_request`).

Departure: halwatch's own detector. LoRA (Hu et al. 2021) is the parameter-efficient update; fine-tuning a model's
own layers with a token head on RAGTruth's span labels is what RAGTruth's fine-tuned baseline and LettuceDetect do
with whole models.
"""

from __future__ import annotations

import numpy as np

from halwatch.detectors import adapter_fit
from halwatch.detectors.base import Detector, groups_of
from halwatch.detectors.classifiers import pack, unpack
from halwatch.detectors.crossfit import OutOfFold
from halwatch.detectors.linear import folds_of
from halwatch.detectors.logistic import sigmoid
from halwatch.errors import HalwatchError, InputError
from halwatch.models import adapter as adapter_lib
from halwatch.models.signal_types import SignalRequest, Signals

#: The raw score of an answer without response tokens.
EMPTY = -20.0


class Adapter(Detector):
    name = "adapter"
    citation = ("halwatch: the scoring model's upper layers fine-tuned with LoRA (Hu et al., 2021) and a token head "
                "on human span labels, read from the one pass")
    supervised = True

    def __init__(self, scorer=None, calibration: str = "platt", rank: int = 8, alpha: float = 16.0, epochs: int = 2,
                 lr: float = 5e-4, accumulate: int = 8, folds: int = 5, seed: int = 0, start: int | None = None,
                 depth: int | None = None, **settings):
        if int(rank) < 1 or int(epochs) < 1 or int(accumulate) < 1 or float(lr) <= 0:
            raise ValueError(f"rank, epochs, accumulate and lr must be positive, got {rank}, {epochs}, {accumulate}"
                             f" and {lr}")
        super().__init__(scorer=scorer, calibration=calibration, rank=int(rank), alpha=float(alpha),
                         epochs=int(epochs), lr=float(lr), accumulate=int(accumulate), folds=int(folds),
                         seed=int(seed), start=start, depth=depth, **settings)
        self.arrays: dict | None = None
        self._request: adapter_lib.AdapterRequest | None = None
        self._held: OutOfFold | None = None

    def layers(self) -> tuple[int, int]:
        """``(start, depth)``: the settings', else :func:`halwatch.models.adapter.default_layers` of the model."""
        s = self.settings
        if s["start"] is None or s["depth"] is None:
            start, depth = adapter_lib.default_layers(self.get_scorer().model.n_layers)
            s["start"] = start if s["start"] is None else int(s["start"])
            s["depth"] = depth if s["depth"] is None else int(s["depth"])
        return int(s["start"]), int(s["depth"])

    def adapter_request(self, arrays: dict | None = None) -> adapter_lib.AdapterRequest:
        """What the pass needs to run the adapter (the fitted one, or one of ``arrays``)."""
        if arrays is None and self._request is not None:
            return self._request
        if arrays is None and self.arrays is None:
            raise HalwatchError(f"detector {self.name!r} is not fitted: call fit() or load a fitted artifact")
        start, depth = self.layers()
        made = adapter_lib.AdapterRequest.of(arrays if arrays is not None else self.arrays, start, depth,
                                             self.settings["rank"], self.settings["alpha"])
        if arrays is None:
            self._request = made
        return made

    def request(self) -> SignalRequest:
        return SignalRequest(adapter=self.adapter_request())

    def raw_scores(self, signals: list[Signals]) -> np.ndarray:
        return np.array([float(s.adapter.max()) if s.adapter is not None and len(s.adapter) else EMPTY
                         for s in signals])

    def token_scores(self, signals: list[Signals]) -> list[np.ndarray]:
        return [sigmoid(np.asarray(s.adapter, dtype=float)) for s in signals]

    def fit(self, samples, labels=None, progress: bool = False) -> "Adapter":
        """Capture the inputs, train the folds' adapters and the one that ships, and fit the operating point and the
        span rule on the folds' held-out scores (module docstring). Resumes an interrupted fit of the same answers
        and settings from its work folder."""
        labels = np.asarray([s.label for s in samples] if labels is None else labels, dtype=int)
        scorer = self.get_scorer()
        views = [scorer.encode(s) for s in samples]
        if not any(v.has_token_labels and v.token_labels().any() for v in views):
            raise InputError("the adapter learns from span labels, and no training answer has a hallucinated span "
                             "(give each hallucinated answer its 'spans')")
        start, depth = self.layers()
        s = self.settings
        recipe = {k: s[k] for k in ("rank", "alpha", "epochs", "lr", "accumulate", "folds", "seed")}
        recipe |= {"start": start, "depth": depth}
        folder = adapter_fit.work_folder(scorer.identity(), views, recipe)
        records = adapter_fit.capture_inputs(scorer.model, views, start, depth, folder, progress)
        groups = groups_of(views)
        held, folds = {}, []
        for k, (train, fold) in enumerate(folds_of(labels, s["folds"], groups, s["seed"])):
            arrays = adapter_fit.train(scorer.model, records, list(train), recipe, folder / f"fold-{k}.pt",
                                       progress, desc=f"adapter fold {k + 1}")
            request = self.adapter_request(arrays)
            held |= adapter_fit.logits_of(scorer.model, request, records, fold)
            folds.append({"sha": request.sha, "sources": sorted(set(groups[fold].tolist()))})
        self.arrays = adapter_fit.train(scorer.model, records, list(range(len(records))), recipe,
                                        folder / "final.pt", progress, desc="adapter")
        self._request = None
        signals = [Signals(n_prompt=v.n_prompt, n_response=v.n_response, adapter=held[i])
                   for i, v in enumerate(views)]
        raw = self.raw_scores(signals)
        self._held = OutOfFold(raw, self.token_scores(signals), raw[:, None])
        try:
            self.fit_signals(signals, labels, views, groups)
        finally:
            self._held = None
        self.fitted_on["work"] = folder.name
        self.fitted_on["folds"] = folds
        return self

    # ---- the folds' adapters, for a stack fitted on the same answers ---------------------------------------------
    def fold_plan(self, views) -> dict[int, list[int]]:
        """``{fold: [indices of views]}``: the views whose source (:attr:`halwatch.sample.Sample.source`) was held
        out of that fold's training, so that their adapter scores are out of fold; a view of any other source
        (never trained on) is in none."""
        where = {source: k for k, fold in enumerate(self.fitted_on.get("folds", ())) for source in fold["sources"]}
        plan: dict[int, list[int]] = {}
        for i, v in enumerate(views):
            k = where.get(v.sample.source)
            if k is not None:
                plan.setdefault(k, []).append(i)
        return plan

    def fold_request(self, k: int) -> adapter_lib.AdapterRequest:
        """Fold ``k``'s adapter, from the fit's work folder under ``$HALWATCH_HOME/fits`` (only the adapter
        trained on every answer ships)."""
        from halwatch.models.registry import home

        fold = self.fitted_on["folds"][k]
        path = home() / "fits" / self.fitted_on["work"] / f"fold-{k}.npz"
        if not path.is_file():
            raise InputError(f"fitting on the answers the adapter was trained on needs its folds' adapters, and "
                             f"{path} is missing: fit the adapter on this machine first (`halwatch fit --detector "
                             f"adapter` with the data it names: {self.fitted_on.get('data', 'see its artifact')})")
        with np.load(path) as saved:
            request = self.adapter_request({k: saved[k] for k in saved.files})
        if request.sha != fold["sha"]:
            raise InputError(f"{path} is not the adapter this artifact's fold {k} was fitted with: fit it again")
        return request

    def fit_out_of_fold(self, signals, labels, views, groups=None) -> OutOfFold:
        """The folds' held-out scores that :meth:`fit` computed (the adapter is trained from captured inputs, not
        from signals: it cannot be fitted on precomputed signals)."""
        if self._held is None:
            raise HalwatchError("the adapter is fitted with fit(samples): it trains on the pass's states, which "
                                "cached signals do not hold")
        return self._held

    def state(self) -> dict:
        return {"arrays": {k: pack(v, "float16") for k, v in (self.arrays or {}).items()}}

    def set_state(self, state: dict) -> None:
        arrays = state.get("arrays") or {}
        self.arrays = {k: unpack(v).astype(np.float32) for k, v in arrays.items()} or None
        self._request = None


def load_adapter(source: str, scorer=None) -> Adapter:
    """A fitted adapter from a shipped artifact's name or an artifact file."""
    from halwatch.detectors.shipped import artifact_json

    data, _ = artifact_json(source)
    kind = data.get("detector") if isinstance(data, dict) else None
    if kind != Adapter.name:
        raise InputError(f"adapter {source!r}: a {kind} artifact, not an adapter")
    return Adapter.from_dict(data, scorer=scorer, precision_warning=False)
