"""The scorer: a scoring model, an input mode and a token cap, turning samples into cached signals."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from halwatch.cache import SignalCache, signal_key
from halwatch.models import forward, registry
from halwatch.models.forward import attach_support
from halwatch.models.loader import ScoringModel, load_model
from halwatch.models.signal_types import SignalRequest, Signals
from halwatch.progress import progress as progress_bar
from halwatch.sample import Sample, task_of
from halwatch.timing import timed
from halwatch.tokens import DEFAULT_MAX_TOKENS, INPUT_MODES, MAX_WINDOWS, TokenView, encode, encode_many, encode_windows

log = logging.getLogger("halwatch")

#: Padded tokens per forward pass when the batch size is chosen by a token budget (``batch_size=None``) on a GPU.
BATCH_TOKENS = {"mps": 8192, "cuda": 32768}
#: Device kinds on which ``batch_size=None`` scores one answer per pass: on a CPU batching gains nothing (1.04 s per
#: answer one at a time against 1.22 s in batches of 8 on a 2-core CPU, docs/scale.md), and in bfloat16 the padding
#: of a batch moves an answer's probability in the third decimal, so that a file's scores would depend on which
#: answers shared its batch (and Ray's actors, which batch other answers together, would differ from a local run).
ONE_PER_PASS = ("cpu",)


class Scorer:
    """Runs the scoring model over ``prompt + response`` (teacher forcing) and returns the signals asked for.

    ``cache``: ``True`` for ``$HALWATCH_HOME/signals``, a folder, or ``None``/``False`` for no cache.
    ``device`` and ``dtype`` (:func:`halwatch.models.loader.load_model`) apply when the model is loaded here.
    ``batch_size``: answers per forward pass, or ``None``: one on a CPU, else as many as fit ``batch_tokens``
    padded tokens (answers are sorted by length first, so a batch pads little; a ``batch_tokens`` given batches on a
    CPU too). ``windows``: the most windows a context longer
    than the cap is scored in (:meth:`encode_windows`; 1: its left part is cut). ``remote``: a function
    ``remote(scorer, samples, request) -> signals`` that computes uncached signals elsewhere
    (:func:`halwatch.scale.ray_signals`). The model is loaded on first use.
    """

    def __init__(self, model: str | ScoringModel = registry.DEFAULT_MODEL, input_mode: str = "raw",
                 max_tokens: int = DEFAULT_MAX_TOKENS, cache: bool | str | Path | None = True,
                 batch_size: int | None = 1, device: str = "auto", dtype: str = "auto",
                 batch_tokens: int | None = None, windows: int = MAX_WINDOWS, remote=None):
        if input_mode not in INPUT_MODES:
            raise ValueError(f"unknown input mode {input_mode!r}: choose one of {', '.join(INPUT_MODES)}")
        if max_tokens < 8:
            raise ValueError(f"max_tokens must be at least 8, got {max_tokens}")
        self._model = model if isinstance(model, ScoringModel) else None
        self.model_name = model.name if isinstance(model, ScoringModel) else model
        self.input_mode = input_mode
        self.max_tokens = max_tokens
        self.batch_size = None if batch_size is None else max(1, batch_size)
        self.batch_tokens = batch_tokens
        if windows < 1:
            raise ValueError(f"windows must be at least 1, got {windows}")
        self.windows = windows
        self.device, self.dtype = device, dtype
        #: ``remote(scorer, samples, request) -> signals``: where uncached signals are computed instead of this process
        #: (:func:`halwatch.scale.ray_signals` for ``--ray``); they are cached here all the same.
        self.remote = remote
        if cache is True:
            cache = registry.home() / "signals"
        self.cache = SignalCache(Path(cache)) if cache else None
        #: requests asked of this scorer that cover the white-box pass and more (it with an adapter): their cached
        #: entries serve the white-box pass and what it covers too
        self.wider: list[SignalRequest] = []

    @classmethod
    def from_options(cls, model: str | ScoringModel | None = None, input_mode: str | None = None,
                     max_tokens: int | None = None, cache: bool | str | Path | None = True,
                     batch_size: int | None = 1, identity: dict | None = None, device: str = "auto",
                     dtype: str = "auto", windows: int = MAX_WINDOWS, remote=None) -> "Scorer":
        """A scorer from optional choices (a command line's), each falling back to an artifact's ``identity``
        (scoring model, input mode, token cap), then to the defaults."""
        identity = identity or {}
        return cls(model=model or identity.get("scoring_model", registry.DEFAULT_MODEL),
                   input_mode=input_mode or identity.get("input_mode", "raw"),
                   max_tokens=max_tokens or identity.get("max_tokens", DEFAULT_MAX_TOKENS),
                   cache=cache, batch_size=batch_size, device=device, dtype=dtype, windows=windows, remote=remote)

    def on_model(self, model: str | ScoringModel) -> "Scorer":
        """A scorer with this one's settings (input mode, token cap, cache, batching, device, precision, windows)
        on another scoring model."""
        return Scorer(model=model, input_mode=self.input_mode, max_tokens=self.max_tokens,
                      cache=self.cache is not None and self.cache.root, batch_size=self.batch_size,
                      device=self.device, dtype=self.dtype, batch_tokens=self.batch_tokens, windows=self.windows,
                      remote=self.remote)

    @property
    def model(self) -> ScoringModel:
        if self._model is None:
            self._model = load_model(self.model_name, device=self.device, dtype=self.dtype)
            self.model_name = self._model.name
        return self._model

    def identity(self) -> dict:
        """What every result and artifact records about how its signals were made."""
        return {
            "scoring_model": self.model.name,
            "weights_sha256": self.model.weights_hash,
            "input_mode": self.input_mode,
            "max_tokens": self.max_tokens,
            "dtype": self.model.dtype,
        }

    def encode(self, sample: Sample) -> TokenView:
        return encode(sample, self.model.tokenizer, self.input_mode, self.max_tokens)

    def encode_windows(self, sample: Sample) -> list[TokenView]:
        """The views that scoring uses: one, or the windows of a context longer than the token cap (at most
        ``windows``; :func:`halwatch.tokens.encode_windows`). Fitting fits on :meth:`encode`'s one view and
        calibrates on these (:meth:`windowed`)."""
        return encode_windows(sample, self.model.tokenizer, self.input_mode, self.max_tokens, self.windows)

    @timed("tokenizing")
    def encode_many(self, samples: list[Sample], windows: bool = True, keep_errors: bool = False) -> list:
        """Every sample's views, tokenized together (:func:`halwatch.tokens.encode_many`): those of
        :meth:`encode_windows`, or with ``windows=False`` :meth:`encode`'s one view. A sample that cannot be encoded
        raises its :class:`~halwatch.errors.InputError`, or with ``keep_errors`` gets it in its place."""
        return encode_many(samples, self.model.tokenizer, self.input_mode, self.max_tokens,
                           self.windows if windows else 1, keep_errors)

    def windowed(self, views: list[TokenView], signals: list[Signals], request: SignalRequest,
                 progress: bool = False) -> tuple[list[TokenView], list[Signals]]:
        """``views`` and ``signals`` (one per answer, :meth:`encode`'s) with each answer whose context the token cap
        cut replaced by its windows (:meth:`encode_windows`), as scoring sees it; the windows' signals come from the
        cache or one batched pass (with the white-box pass's request where that covers ``request``). Unchanged when
        this scorer scores in one window."""
        long = [i for i, v in enumerate(views) if v.cut_chars] if self.windows > 1 else []
        if not long:
            return views, signals
        windows = {i: self.encode_windows(views[i].sample) for i in long}
        flat = [w for i in long for w in windows[i]]
        whitebox = forward.whitebox_request(self.model)
        request = whitebox if whitebox.covers(request) else request
        found = iter(self.signals([w.sample for w in flat], request, progress=progress, views=flat))
        out_views, out_signals = [], []
        for i, (view, sig) in enumerate(zip(views, signals)):
            mine = windows.get(i, [view])
            out_views += mine
            out_signals += [next(found) for _ in mine] if i in windows else [sig]
        return out_views, out_signals

    def _check(self, request: SignalRequest) -> None:
        m = self.model
        bad_layers = [i for i in request.hidden_layers if not 0 <= i <= m.n_layers]
        bad_heads = [h for h in request.heads if not (0 <= h[0] < m.n_layers and 0 <= h[1] < m.n_heads)]
        if bad_layers or bad_heads:
            raise ValueError(
                f"{m.name} has {m.n_layers} layers x {m.n_heads} heads; asked for hidden layers {bad_layers} "
                f"and heads {bad_heads}"
            )

    def cache_key(self, view: TokenView, request: SignalRequest) -> str:
        """What names ``view``'s signals for ``request`` in the signal cache."""
        return signal_key(self.model.name, self.model.weights_hash, self.input_mode, view.input_ids, view.n_prompt,
                          request, n_header=view.n_header, dtype=self.model.dtype)

    def lookup(self, view: TokenView, request: SignalRequest) -> Signals | None:
        """``view``'s signals for exactly ``request`` from the cache (``None``: not there, or no cache)."""
        return None if self.cache is None else self.cache.get(self.cache_key(view, request))

    def store(self, view: TokenView, request: SignalRequest, signals: Signals) -> None:
        """Keep ``signals`` as ``view``'s for ``request`` in the cache (nothing without one)."""
        if self.cache is not None:
            self.cache.put(self.cache_key(view, request), signals)

    def cached(self, views: list[TokenView], request: SignalRequest) -> list[bool]:
        """Whether each view's signals for ``request`` are in the cache (its own entry, or the white-box pass's
        where that covers the request): what :meth:`signals` would read instead of computing."""
        if self.cache is None:
            return [False] * len(views)
        serving = self._serving(request)
        return [any(self.cache.has(self.cache_key(v, r)) for r in serving) for v in views]

    def _serving(self, request: SignalRequest) -> list[SignalRequest]:
        """The requests whose cache entries serve ``request``: itself, then the full white-box pass where that
        covers it, then the wider passes asked of this scorer before (:attr:`wider`) that cover it."""
        whitebox = forward.whitebox_request(self.model)
        if request != whitebox and request.covers(whitebox) and request not in self.wider:
            self.wider.append(request)
        return [request] + [r for r in (whitebox, *self.wider) if r != request and r.covers(request)]

    def _compute(self, views: list[TokenView], request: SignalRequest) -> list[Signals]:
        """One batch: the forward pass (when the request asks for anything from it), then any sampled answers and
        any ``extra`` pass of a detector module."""
        from halwatch.models.sampling import sample_answers

        base = request.without_sampling()
        if base == SignalRequest():
            out = [Signals(n_prompt=v.n_prompt, n_response=v.n_response) for v in views]
        else:  # the lexical support in the pass, made while the device finishes the batch
            out = forward.run(self.model, views, replace(base, support=request.support))
        if request.sampling is not None:
            for v, sig in zip(views, out):
                sig.generations = sample_answers(self.model, v, request.sampling, self.input_mode)
        if request.extra is not None:
            for sig, values in zip(out, request.extra.compute(self, views)):
                sig.extra = values
        return out

    def batches(self, lengths: list[int], batch_size=...) -> list[list[int]]:
        """Consecutive batches of indices into ``lengths`` (token counts, sorted ascending): ``batch_size`` (by
        default the scorer's) at a time, or with ``None`` one at a time on a CPU (:data:`ONE_PER_PASS`) and as many
        as fit the token budget elsewhere (answers x longest; by default :data:`BATCH_TOKENS` of the model's device
        kind)."""
        size = self.batch_size if batch_size is ... else (None if batch_size is None else max(1, int(batch_size)))
        kind = self.model.device.type
        if size is None and kind in ONE_PER_PASS and not self.batch_tokens:
            size = 1
        if size is not None:
            return [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]
        budget = self.batch_tokens or BATCH_TOKENS.get(kind, BATCH_TOKENS["mps"])
        out: list[list[int]] = []
        for i, n in enumerate(lengths):
            if out and n * (len(out[-1]) + 1) <= budget:
                out[-1].append(i)
            else:
                out.append([i])
        return out

    def signals(self, samples: list[Sample], request: SignalRequest, progress: bool = False,
                views: list[TokenView] | None = None, bar=None, batch_size=...) -> list[Signals]:
        """Signals of every sample, from the cache where present, else from batched forward passes. ``bar``: a
        caller's progress bar over several calls, advanced by every sample (cached ones at once) instead of a
        bar of this call's forward passes (``progress``). ``batch_size``: answers per forward pass, where not
        the scorer's own (:meth:`batches`)."""
        self._check(request)
        views = views if views is not None else [self.encode(s) for s in samples]
        results: list[Signals | None] = [None] * len(views)
        keys = [None] * len(views)
        fallbacks = self._serving(request)[1:]  # a cached entry of the full white-box pass serves what it covers
        todo = []
        for i, v in enumerate(views):
            if self.cache is not None:
                keys[i] = self.cache_key(v, request)
                results[i] = self.cache.get(keys[i])
                for other in fallbacks:
                    if results[i] is None:
                        results[i] = self.cache.get(self.cache_key(v, other))
            if results[i] is None:
                todo.append(i)
        todo.sort(key=lambda i: len(views[i].input_ids))

        def keep(i: int, sig: Signals) -> None:
            results[i] = sig
            if self.cache is not None:
                self.cache.put(keys[i], sig)

        if todo and self.remote is not None:
            # the remote encodes each sample itself (encode's one view): a window of a long context other than the
            # last is not that view, and is computed here
            away = [i for i in todo if views[i].window[0] == views[i].window[1] - 1]
            for i, sig in zip(away, self.remote(self, [samples[i] for i in away], request)):
                keep(i, sig)
            todo = [i for i in todo if views[i].window[0] != views[i].window[1] - 1]
        if bar is not None:
            bar.update(len(views) - len(todo))
        with (nullcontext(bar) if bar is not None else
              progress_bar(total=len(todo), disable=not progress or not todo, desc="forward", unit="sample")) as bar:
            for batch in self.batches([len(views[i].input_ids) for i in todo], batch_size):
                batch = [todo[j] for j in batch]
                for i, sig in zip(batch, self._compute([views[i] for i in batch], request)):
                    keep(i, sig)
                bar.update(len(batch))
        fresh = set(todo)
        for i, (view, sig) in enumerate(zip(views, results)):
            # neither is cached: a cached pass may have served another view with the same input ids
            sig.task = task_of(view.sample)
            if request.support and (i not in fresh or sig.support is None):
                attach_support(view, sig)
        return results
