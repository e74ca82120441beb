"""The fused detector: every signal of the one white-box pass, the lexical support of the answer by its context, the
human span labels, and honest stacking.

Answer level, one regularised logistic regression per family of signals (each a published method's feature):

- ``lookback``: the time-mean lookback ratio of every head (Lookback Lens, section 2.1);
- ``toha``: the normalised MTop-Div ``d`` of every head (TOHA, eq. 3), all heads rather than a selection;
- ``diag``: the mean log attention of each response token on itself, per head (LLM-Check's attention score);
- ``hidden``: the mean hidden state of the middle and of the last layer over the response (the linear probe);
- ``uncertainty``: surprisal and predictive-entropy statistics of the response tokens (perplexity, max and mean
  entropy and their spread);
- ``support``: the lexical support of the response by its context (:mod:`halwatch.signals.support`: shares of
  content words, bigrams and trigrams absent from the context, unsupported numbers and names);
- ``adapter`` (with the ``adapter`` setting, a fitted adapter artifact: :mod:`halwatch.detectors.adapter`): the
  highest, top-``pool_k`` mean and mean token log-odds of the scoring model's fine-tuned upper layers, run on the
  pass's own states; each token's log-odds is one more token feature too. The answers the adapter was trained on
  get the log-odds of the fold's adapter that did not see their source (:meth:`Fused.fit_signals`), so that the
  stack is fitted on out-of-fold values there as everywhere.

The attention-sink feature (the mean attention on the first input token) was dropped: it moved with the prompt's
length and template rather than with support (about +2 logits per token on 100-token prompts and about 0 on RAGTruth's
300-token ones), a shortcut that made every short answer over a short context look hallucinated.

Token level (``tokens``): a model of every response token's features (the lookback ratio, MTop-Div edge weight
and log self-attention of every head, the middle layer's hidden state, surprisal, entropy, the relative position and
the token's lexical support flags), trained on the human span labels (a token is hallucinated when it overlaps a gold
span; an answer labelled hallucinated without spans is left out of this loss). ``token_kind="bigru"`` (the default)
reads the answer's tokens in both directions (:mod:`halwatch.detectors.sequence`), so that each token is judged with
its neighbours; with ``copy=true`` each token also has every head's copy attention (the attention that the step
generating it puts on the context tokens equal to it, :func:`halwatch.signals.reducers.copy`), an alignment of the
answer with its context; ``"linear"`` is a logistic regression on each token alone, its probabilities smoothed over
``smooth`` neighbouring tokens. The token probabilities are the detector's token scores and give its spans; their
maximum, top-``pool_k`` mean and mean over the answer feed the answer-level model (hallucinations are short: a
whole-answer mean dilutes them).

The answer score is a stacked logistic regression over the families' log-odds, the pooled token scores and the log
response length as an explicit feature (its coefficient is reported: the detector must beat length, not rediscover
it). Stacking is out of fold (:func:`halwatch.detectors.crossfit.cross_fit`), with folds that keep the answers to one
source together: every family model and the token model are fitted on four fifths of the probe and score the fifth
they did not see, the stacker is fitted on those held-out scores, and the calibration and the thresholds on the
stacker's own held-out scores. Regularisation is chosen by source-grouped cross-validation everywhere.

Departures: this is halwatch's own combination, not a published method; each family is its paper's feature, but
TOHA's heads are all kept (weighted by the regression) instead of Algorithm 1's top-N mean.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from halwatch.detectors import linear, sequence
from halwatch.detectors.adapter import load_adapter
from halwatch.detectors.base import Detector
from halwatch.detectors.crossfit import OutOfFold, cross_fit
from halwatch.detectors.linear import folds_of
from halwatch.detectors.logistic import sigmoid
from halwatch.errors import HalwatchError
from halwatch.models.forward import whitebox_request
from halwatch.models.signal_types import SignalRequest
from halwatch.timing import timed

TOKEN_KINDS = ("bigru", "linear")
FAMILIES = ("lookback", "toha", "diag", "hidden", "uncertainty", "support")
POOLED = ("token_max", "token_top", "token_mean")
#: The inverse regularisation strengths the token classifier chooses from (``token_C="cv"``): on the order of one
#: over the number of tokens it is fitted on, hundreds of thousands.
TOKEN_C_GRID = (1e-5, 1e-4, 1e-3, 1e-2)


def _smooth(values: np.ndarray, width: int) -> np.ndarray:
    if width <= 1 or len(values) < 2:
        return values
    kernel = np.ones(width) / width
    padded = np.pad(values, (width // 2, width - 1 - width // 2), mode="edge")
    return np.convolve(padded, kernel, mode="valid")


class Fused(Detector):
    name = "fused"
    citation = ("halwatch fused detector: stacked TOHA, Lookback Lens, LLM-Check, linear-probe, uncertainty and "
                "lexical-support features with a token classifier on human span labels")
    supervised = True

    def __init__(self, scorer=None, calibration: str = "platt", C: float | str = "cv", token_C: float | str = "cv",
                 folds: int = 5, smooth: int = 3, pool_k: int = 3, negatives: float = 0.25,
                 drop: tuple | list | str = (), balance: bool = False, token_kind: str = "bigru",
                 token_epochs: int = sequence.EPOCHS, token_hidden: int = sequence.HIDDEN, copy: bool = False,
                 adapter: str | None = None, **settings):
        if isinstance(drop, str):  # from a command line: drop=tokens+hidden
            drop = [part for part in drop.split("+") if part]
        unknown = sorted(set(drop) - set(FAMILIES) - {"tokens", "length", "adapter"})
        if unknown:
            raise ValueError(f"drop: unknown signal families {unknown}: choose from "
                             f"{FAMILIES + ('adapter', 'tokens', 'length')}")
        if token_kind not in TOKEN_KINDS:
            raise ValueError(f"token_kind: choose one of {', '.join(TOKEN_KINDS)}, not {token_kind!r}")
        if not 0 < float(negatives) <= 1:
            raise ValueError(f"negatives: the share of grounded tokens kept must be in (0, 1], not {negatives}")
        super().__init__(scorer=scorer, calibration=calibration, C=C, token_C=token_C, folds=int(folds),
                         smooth=int(smooth), pool_k=int(pool_k), negatives=float(negatives), drop=sorted(drop),
                         balance=_flag(balance, "balance", "datasets"), token_kind=token_kind,
                         token_epochs=int(token_epochs), token_hidden=int(token_hidden),
                         **({"copy": True} if _flag(copy, "copy") else {}),
                         **({"adapter": str(adapter)} if adapter else {}), **settings)
        self.adapter = None  # the fitted adapter detector that the ``adapter`` setting names, once loaded
        self.adapter_sha: str | None = None  # the digest of the adapter the stack was fitted with
        self.families: dict = {}
        self.token_model: dict | None = None
        self.stacker: dict = {}
        self.columns: list[str] = []

    # ---- features -----------------------------------------------------------------------------------------------
    def _layout(self):
        model = self.get_scorer().model
        return model.all_heads(), model.n_layers // 2, model.n_layers

    def request(self) -> SignalRequest:
        return signal_request(self.get_scorer().model, self.settings.get("copy", False), self.adapter_request())

    def adapter_request(self):
        """The adapter the pass runs (``None`` without the ``adapter`` setting)."""
        if not self.settings.get("adapter"):
            return None
        if self.adapter is None:
            self.adapter = load_adapter(self.settings["adapter"], self.get_scorer())
        request = self.adapter.adapter_request()
        if self.adapter_sha is not None and request.sha != self.adapter_sha:
            raise HalwatchError(f"the adapter {self.settings['adapter']!r} is not the one this detector was fitted "
                                f"with (digest {request.sha[:12]}, fitted with {self.adapter_sha[:12]}): fit it again")
        return request

    def families_used(self) -> tuple[str, ...]:
        """The answer-level families this detector stacks: :data:`FAMILIES`, and ``adapter`` where it has one."""
        return FAMILIES + (("adapter",) if self.settings.get("adapter") else ())

    def fit_signals(self, signals, labels, views=None, groups=None, scored=None):
        """:meth:`Detector.fit_signals`, with the adapter's log-odds of the answers it was trained on replaced by
        its folds' (module docstring)."""
        if self.settings.get("adapter"):
            if views is None:
                raise ValueError("a stack with an adapter needs the answers' views to find those the adapter was "
                                 "trained on")
            signals = self._held_adapter(signals, views)
            if scored is not None:
                scored = (scored[0], self._held_adapter(scored[1], scored[0]))
        return super().fit_signals(signals, labels, views, groups, scored)

    def adapter_trained_on(self, views) -> list[int]:
        """The indices of ``views`` whose source the ``adapter`` setting's adapter was trained on (in one of its
        folds): scores of them are not held out. Empty without an adapter."""
        if not self.settings.get("adapter"):
            return []
        self.adapter_request()
        return sorted(i for idx in self.adapter.fold_plan(views).values() for i in idx)

    def _held_adapter(self, signals, views) -> list:
        """``signals`` with ``adapter`` from the fold's adapter that did not see each answer's source, for the
        answers the adapter was trained on (one pass each, cached as any signal is); the others unchanged."""
        self.adapter_request()
        scorer = self.get_scorer()
        out = list(signals)
        for k, idx in sorted(self.adapter.fold_plan(views).items()):
            mine = [views[i] for i in idx]
            got = scorer.signals([v.sample for v in mine], SignalRequest(adapter=self.adapter.fold_request(k)),
                                 views=mine)
            for i, sig in zip(idx, got):
                out[i] = dataclasses.replace(out[i], adapter=sig.adapter)
        return out

    @timed("answer features")
    def answer_features(self, signals) -> dict[str, np.ndarray]:
        heads, mid, last = self._layout()
        out = {name: [] for name in self.families_used()}
        for s in signals:
            out["lookback"].append(s.head_values("lookback.ratio", heads).mean(1))
            out["toha"].append(s.head_values("mtopdiv.d", heads))
            out["diag"].append(np.log(np.clip(s.head_values("diag.w", heads), 1e-6, None)).mean(1))
            out["hidden"].append(np.concatenate([s.hidden[s.hidden_layers.index(mid), 0],
                                                 s.hidden[s.hidden_layers.index(last), 0]]))
            surprisal, entropy = -s.logprobs.astype(float), s.entropy.astype(float)
            out["uncertainty"].append(np.array([
                surprisal.mean(), surprisal.max(), np.quantile(surprisal, 0.9), surprisal.std(),
                entropy.mean(), entropy.max(), np.quantile(entropy, 0.9), entropy.std()]))
            out["support"].append(_support(s).support_answer)
            if "adapter" in out:
                out["adapter"].append(self._adapter_pooled(s))
        return {k: np.stack(v).astype(np.float64) for k, v in out.items()}

    def _adapter_pooled(self, sig) -> np.ndarray:
        """The highest, top-``pool_k`` mean and mean of the adapter's token log-odds."""
        if sig.adapter is None:
            raise ValueError("the signals hold no adapter log-odds: get them with this detector's request()")
        x = np.sort(np.asarray(sig.adapter, dtype=float))
        return np.array([x[-1], x[-self.settings["pool_k"]:].mean(), x.mean()])

    @timed("token features")
    def token_features(self, sig) -> np.ndarray:
        """``[R, F]``: per response token, every head's lookback ratio, MTop-Div edge weight and log
        self-attention, the middle layer's hidden state, surprisal, entropy, the relative position and the lexical
        support flags (and with ``copy``, every head's copy attention)."""
        heads, mid, _ = self._layout()
        r = sig.n_response
        parts = [sig.head_values("lookback.ratio", heads).T, sig.head_values("mtopdiv.token_weights", heads).T,
                 np.log(np.clip(sig.head_values("diag.w", heads), 1e-6, None)).T,
                 sig.token_hidden[sig.token_hidden_layers.index(mid)].astype(np.float32),
                 -sig.logprobs[:, None], sig.entropy[:, None], (np.arange(r) / max(r - 1, 1))[:, None],
                 _support(sig).support]
        if self.settings.get("copy"):
            parts.append(sig.head_values("copy.mass", heads).T)
        if self.settings.get("adapter"):
            parts.append(np.asarray(sig.adapter)[:, None])
        return np.concatenate([np.asarray(p, dtype=np.float32) for p in parts], axis=1)

    # ---- pieces -------------------------------------------------------------------------------------------------
    def _fit_tokens(self, x: list, y: list, C="cv", groups=None) -> dict:
        """The token model: the bidirectional GRU (:mod:`halwatch.detectors.sequence`), or the logistic regression
        on every hallucinated token and a seeded ``negatives`` share of the others, each kept negative weighted by
        the inverse of that share (the weighted log-loss estimates the full one; the matrix shrinks about
        threefold). ``groups``: the source of each answer, for the choice of ``C``."""
        if self.settings["token_kind"] == "bigru":
            return sequence.fit(x, y, hidden=self.settings["token_hidden"], epochs=self.settings["token_epochs"])
        owner = np.concatenate([np.full(len(t), i if groups is None else groups[i]) for i, t in enumerate(x)])
        labels = np.concatenate(y).astype(np.float32)
        rate = float(self.settings["negatives"])
        keep = (labels > 0) | (np.random.default_rng(0).random(len(labels)) < rate)
        weights = np.where(labels[keep] > 0, 1.0, 1.0 / rate)
        return linear.fit(np.concatenate(x)[keep], labels[keep], C=C, grid=TOKEN_C_GRID, groups=owner[keep],
                          folds=3, weights=weights)

    @timed("token model")
    def _token_probs(self, model: dict, x: list) -> list[np.ndarray]:
        if model.get("kind") == "bigru":
            return [sigmoid(z) for z in sequence.logodds(model, x, self.get_scorer().model.device)]
        return [_smooth(sigmoid(linear.logodds(model, t)), self.settings["smooth"]) for t in x]

    def _pooled(self, probs: list[np.ndarray]) -> np.ndarray:
        k = self.settings["pool_k"]
        rows = [[p.max(), np.sort(p)[-k:].mean(), p.mean()] for p in probs]
        return np.log(np.clip(np.array(rows), 1e-6, 1 - 1e-6) / np.clip(1 - np.array(rows), 1e-6, None))

    def _stack_columns(self, family_logodds: dict, pooled, lengths) -> tuple[np.ndarray, list[str]]:
        cols, names = [], []
        for name in self.families_used():
            if name not in self.settings["drop"]:
                cols.append(family_logodds[name])
                names.append(name)
        if pooled is not None and "tokens" not in self.settings["drop"]:
            cols += list(pooled.T)
            names += list(POOLED)
        if "length" not in self.settings["drop"]:
            cols.append(np.log(np.asarray(lengths, dtype=float)))
            names.append("log_length")
        return np.stack(cols, axis=1), names

    # ---- fitting ------------------------------------------------------------------------------------------------
    def fit_out_of_fold(self, signals, labels, views, groups=None) -> OutOfFold:
        """Out-of-fold stacking (module docstring): fits the families, the token model and the stacker on the whole
        probe, and returns the stacker's held-out scores, the held-out token scores, the stacker's inputs (every
        column scored out of fold: the OOD reference's) and each fold's whole model."""
        labels = np.asarray(labels, dtype=int)
        feats = self.answer_features(signals)
        use_tokens = views is not None and "tokens" not in self.settings["drop"]
        tok_x = [self.token_features(s) for s in signals] if use_tokens else None
        tok_y = [v.token_labels() for v in views] if use_tokens else None
        labelled = np.array([v.has_token_labels for v in views]) if use_tokens else None
        lengths = [s.n_response for s in signals]
        folds = folds_of(labels, self.settings["folds"], groups)
        n = len(labels)
        w = (balanced_weights(labels, views, sets=self.settings["balance"] == "datasets")
             if self.settings.get("balance") else np.ones(n))

        def family(name, c):
            return cross_fit(folds, lambda tr: linear.fit(feats[name][tr], labels[tr], C=c, weights=w[tr]),
                             lambda m, held: linear.logodds(m, feats[name][held]), n)

        def token_fit(train, c):
            train = [i for i in train if labelled[i]]
            return self._fit_tokens([tok_x[i] for i in train], [tok_y[i] for i in train], c,
                                    None if groups is None else [groups[i] for i in train])

        # regularisation chosen once on the whole probe (source-grouped cross-validation), then fixed in the folds
        chosen = {name: linear.fit(feats[name], labels, C=self.settings["C"], groups=groups, weights=w)["C"]
                  for name in self.families_used() if name not in self.settings["drop"]}
        by_family = {name: family(name, c) for name, c in chosen.items()}
        held_family = {name: np.array(out) for name, (out, _) in by_family.items()}
        pooled, held_tokens, token_C, token_models = None, None, self.settings["token_C"], None
        if use_tokens:
            if token_C == "cv" and self.settings["token_kind"] == "linear":
                token_C = token_fit(np.arange(n), "cv")["C"]
            held_tokens, token_models = cross_fit(
                folds, lambda tr: token_fit(tr, token_C),
                lambda m, held: self._token_probs(m, [tok_x[i] for i in held]), n)
            pooled = self._pooled(held_tokens)
        stack_x, self.columns = self._stack_columns(held_family, pooled, lengths)
        self.stacker = linear.fit(stack_x, labels, C=self.settings["C"], groups=groups, weights=w)
        held_raw, stackers = cross_fit(folds, lambda tr: linear.fit(stack_x[tr], labels[tr], C=self.stacker["C"],
                                                                    weights=w[tr]),
                                       lambda m, held: linear.logodds(m, stack_x[held]), n)
        # each fold's whole model (its families, token model and stacker), to score the answers it did not see
        # as scoring sees them (crossfit.as_scored)
        folds_fitted = []
        for k, (_, held) in enumerate(stackers):
            copy = self.fold_copy()
            copy.set_state({"families": {name: models[k][0] for name, (_, models) in by_family.items()},
                            "token_model": None if token_models is None else token_models[k][0],
                            "stacker": stackers[k][0], "columns": self.columns})
            folds_fitted.append((copy, held))
        # the parts used at scoring time, fitted on the whole probe
        self.families = {name: linear.fit(feats[name], labels, C=c, weights=w) for name, c in chosen.items()}
        self.token_model = token_fit(np.arange(n), token_C) if use_tokens else None
        return OutOfFold(np.array(held_raw, dtype=float), held_tokens, stack_x, folds_fitted)

    # ---- scoring ------------------------------------------------------------------------------------------------
    def _stack_inputs(self, signals, tokens=None) -> np.ndarray:
        """The stacker's inputs; ``tokens``: the batch's token scores where they are at hand."""
        feats = self.answer_features(signals)
        family = {name: linear.logodds(model, feats[name]) for name, model in self.families.items()}
        tokens = self.token_scores(signals) if tokens is None else tokens
        pooled = None if tokens is None else self._pooled(tokens)
        return self._stack_columns(family, pooled, [s.n_response for s in signals])[0]

    def outputs(self, signals):
        tokens = self.token_scores(signals)
        inputs = self._stack_inputs(signals, tokens)
        return linear.logodds(self.stacker, inputs), tokens, inputs

    def ood_inputs(self, signals):
        return self._stack_inputs(signals)

    def raw_scores(self, signals):
        return linear.logodds(self.stacker, self._stack_inputs(signals))

    def token_scores(self, signals):
        if self.token_model is None:
            return None
        return self._token_probs(self.token_model, [self.token_features(s) for s in signals])

    def coefficients(self) -> dict[str, float]:
        """The stacker's weight of each input, on standardised inputs (the log length's among them)."""
        return dict(zip(self.columns, (round(float(c), 4) for c in linear.coefficients(self.stacker))))

    def state(self):
        if self.settings.get("adapter") and self.adapter_sha is None:
            self.adapter_sha = self.adapter_request().sha
        return {"families": self.families, "token_model": self.token_model, "stacker": self.stacker,
                "columns": self.columns, "coefficients": self.coefficients(),
                **({"adapter_sha": self.adapter_sha} if self.adapter_sha else {})}

    def set_state(self, state):
        self.families, self.token_model = state["families"], state.get("token_model")
        self.stacker, self.columns = state["stacker"], state["columns"]
        self.adapter_sha = state.get("adapter_sha")


def signal_request(model, copy: bool = False, adapter=None) -> SignalRequest:
    """The pass a fused detector reads: the white-box pass, with ``copy`` the copy attention of every head, and the
    ``adapter`` (:class:`halwatch.models.adapter.AdapterRequest`) where there is one."""
    request = whitebox_request(model)
    if copy:
        request = request.merge(SignalRequest(heads=model.all_heads(), reducers=("copy",)))
    return request.merge(SignalRequest(adapter=adapter)) if adapter is not None else request


def _flag(value, name: str, other: str | None = None):
    """A boolean setting, from Python or from a command line's ``--set NAME=true``; ``other``: one more word it may
    be (``balance``: ``datasets``)."""
    if other is not None and value == other:
        return value
    if not isinstance(value, bool):
        raise ValueError(f"{name}: true or false{f' (or {other})' if other else ''}, not {value!r}")
    return value


def balanced_weights(labels, views, sets: bool = False) -> np.ndarray:
    """Per answer, ``0.5 / share of its label in its dataset`` (``meta["dataset"]``): every dataset's hallucinated
    and grounded answers weigh the same, so that no dataset's base rate (XSum's summaries are 90 % hallucinated)
    becomes part of the score. With ``sets``, each dataset also weighs the same in all (its answers' weights sum to
    ``n / number of datasets``), so that a large set does not outvote a small one. The weights sum to ``n``. Uniform
    without views."""
    labels = np.asarray(labels, dtype=int)
    if views is None:
        return np.ones(len(labels))
    names = np.array([str(v.sample.meta.get("dataset", "-")) for v in views])
    datasets = np.unique(names)
    w = np.ones(len(labels))
    for name in datasets:
        inside = names == name
        size = len(labels) / len(datasets) if sets else inside.sum()
        for label in (0, 1):
            hit = inside & (labels == label)
            if hit.any():
                w[hit] = 0.5 * size / hit.sum()
    return w


def _support(sig):
    """``sig`` with its lexical support, which the scorer attaches; signals made without it cannot be scored."""
    if sig.support is None or sig.support_answer is None:
        raise ValueError("the fused detector needs the lexical support of each answer (SignalRequest.support): "
                         "get signals from Scorer.signals")
    return sig
