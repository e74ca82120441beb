"""``halwatch serve``: the scoring service.

- ``POST /v1/score``: one item (a JSON object) or a list of items; each has ``response`` and either ``prompt``, or
  ``context`` (or ``contexts``, joined by blank lines) with ``question`` where the task has one and ``task`` (``qa``,
  ``summary``, ``dialogue``, ``data2text``; default ``qa`` with a question, ``summary`` without); optional ``id``
  and ``detector``. Each
  result has ``score`` (probability of hallucination), ``hallucinated``, the ``threshold`` used, ``spans``
  (character offsets into the response, ``offset_unit`` code points, with the text), the detector, scoring model and
  input mode, ``windows``: how many windows of a context longer than the token cap the answer was scored against
  (:meth:`halwatch.detectors.base.Detector.answer_outputs`), ``truncated``: how many context tokens no window held,
  and ``ood``: how far the answer's inputs lie from the detector's training data. A response that does not fit the
  scoring model is refused (422), never cut.
- ``GET /v1/detectors``: what is loaded, with what each was fitted on.
- ``POST /v1/watch/check``: HalMit's monitor (Algorithm 1) for a query, against the configured store.
- ``POST /v1/chat/completions`` with ``--upstream``: the guard proxy (:mod:`halwatch.serve.guard`).
- ``GET /``: a web page to try it.

Scoring goes through one worker. A request is admitted when its tokens fit the queue (``queue_tokens``) and, at the
seconds per token the worker has measured, it can be answered within ``timeout``; otherwise it is refused at once
(429 with ``Retry-After``; 413 when it is larger than the whole queue). Answers of clients that went away are dropped
before they are scored. The batcher takes as many queued answers as fit a batch (``batch_size`` answers,
``batch_tokens`` padded tokens, answers of similar length so that at most ``batch_padding`` of the positions are
padding) or arrive within ``batch_wait`` seconds, and scores them with one padded forward pass per scoring model off
the event loop. Requests are tokenized off the event loop too.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from fastapi import Request

from halwatch.errors import HalwatchError, InputError
from halwatch.pipeline import Job, Pipeline, score_jobs
from halwatch.result import Result
from halwatch.serve.common import (
    STREAM_POLICIES,
    ApiError,
    ServerState,
    create_app,
    errors,
    read_json,
    watch_disconnect,
)
from halwatch.serve.schema import EXAMPLE, DetectorList, ScoreItem, WatchQuery, WatchVerdict, parse_items
from halwatch.serve.worker import Worker
from halwatch.tokens import MAX_WINDOWS

#: The longer warm-up answer: this many copies of :data:`EXAMPLE`'s response (about 100 response tokens).
WARM_UP_SENTENCES = 8

#: What one answer costs beyond its tokens, in tokens (the fixed part of a forward pass and of the detector's
#: work). With :data:`ATTENTION_TOKENS`, a least-squares fit of the default's time per answer on a 2-core CPU over
#: contexts of 15-800 and responses of 15-420 tokens: 0.116 s + 1.29 ms per token + 3.4 us per response x total
#: token, every answer within 12 % of its measured time. Tokens alone had answers of 400 response tokens cost 1.8x
#: the seconds per token of the warm-up answer, so the first admissions of a flood of long answers under-estimated
#: their time.
ANSWER_OVERHEAD_TOKENS = 90

#: The attention work (the capture's rows, MTop-Div, the lookback ratios) grows with response tokens x all tokens:
#: one token of cost per ``ATTENTION_TOKENS`` of that product.
ATTENTION_TOKENS = 384


def view_cost(view) -> int:
    """The cost of scoring one token view, in tokens of model work: its tokens, and its attention work in tokens."""
    n = len(view.input_ids)
    return n + view.n_response * n // ATTENTION_TOKENS


@dataclass
class _Job(Job):
    """One answer waiting for the batcher: its :class:`~halwatch.pipeline.Job`, its request's future, and its
    times."""

    future: asyncio.Future | None = None
    queued_at: float = 0.0
    waited: float = 0.0
    computed: float = 0.0

    @property
    def tokens(self) -> int:
        """The answer's input tokens (of all its windows)."""
        return sum(len(v.input_ids) for v in self.views)

    @property
    def cost(self) -> int:
        return sum(view_cost(v) for v in self.views) + ANSWER_OVERHEAD_TOKENS


def pick_batch(lengths: list[int], size: int, tokens: int, padding: float) -> list[int]:
    """Indices (into ``lengths``, token counts of waiting answers in arrival order) of the next batch: the oldest
    answer, then the others nearest to it in length while the batch holds at most ``size`` answers, at most
    ``tokens`` padded tokens (answers x longest), and at most a ``padding`` share of padded positions."""
    first = lengths[0]
    chosen, longest, total = [0], first, first
    for i in sorted(range(1, len(lengths)), key=lambda i: (abs(lengths[i] - first), i)):
        if len(chosen) >= size:
            break
        top = max(longest, lengths[i])
        padded = top * (len(chosen) + 1)
        if padded > tokens or padded - (total + lengths[i]) > padding * padded:
            continue
        chosen.append(i)
        longest, total = top, total + lengths[i]
    return sorted(chosen)


#: Answers per forward batch when none is given, by the device kind of the scoring model: on a 2-core CPU one
#: answer's forward pass already keeps both cores busy, so batches only add waiting (``halwatch bench serve``).
BATCH_SIZE = {"cpu": 1, "cuda": 8, "mps": 8}


@dataclass
class Limits:
    """The service's limits. ``batch_size``: answers per forward batch, or ``None`` for the device's choice
    (:data:`BATCH_SIZE`). ``batch_padding``: the largest share of a batch's positions that may be padding (padding
    is paid in full; 1.0 batches any lengths together). ``min_span_confidence``: the spans a result leaves out unless
    a request says otherwise (``None``: each detector artifact's own, 0 unless set). ``windows``: the most windows a
    context longer than the token cap is scored in (:meth:`halwatch.scorer.Scorer.encode_windows`)."""

    max_items: int = 64
    batch_size: int | None = None  # None: 1 on a CPU (batching gains nothing there), 8 on a GPU
    batch_tokens: int = 8192
    batch_padding: float = 0.1
    batch_wait: float = 0.005
    queue_tokens: int = 1 << 18
    timeout: float = 120.0
    min_span_confidence: float | None = None
    windows: int = MAX_WINDOWS


class ScoringService:
    """Loaded detectors (by name), each on its scorer (:class:`~halwatch.pipeline.Pipeline`), and the batching
    worker that scores their answers."""

    def __init__(self, detectors: list[str], limits: Limits | None = None, watch: dict | None = None,
                 models: dict | None = None, device: str = "auto", dtype: str = "auto"):
        self.names = list(detectors)
        self.device, self.dtype = device, dtype
        self.models = models or {}  # already loaded scoring models, by name
        self.limits = limits or Limits()
        self.pipelines: dict[str, Pipeline] = {}
        self.worker = Worker(self.limits.queue_tokens, self.limits.timeout)
        self.tokenizing = None  # one thread that tokenizes requests off the event loop (set by ``load``)
        self.queue: asyncio.Queue | None = None
        self.watch = watch
        self.batch_sizes: list[int] = []
        self.batch_size = self.limits.batch_size or 1  # resolved by ``load`` when the limits leave it to the device
        self.on_batch = None
        self.on_job = None  # called with (job, result) for every answer scored (metrics)

    @property
    def default(self) -> str:
        return self.names[0]

    def load(self) -> None:
        """Load every detector, sharing one scorer (and model) among detectors of the same scoring model, input
        mode and token cap; scorers cache nothing on disk."""
        from halwatch.detectors import load_detector, read_artifact
        from halwatch.scorer import Scorer

        scorers = {}
        for name in self.names:
            artifact = read_artifact(name)
            key = (artifact.get("scoring_model"), artifact.get("input_mode"), artifact.get("max_tokens"))
            if key not in scorers:
                scorers[key] = Scorer.from_options(model=self.models.get(key[0]), identity=artifact, cache=None,
                                                   device=self.device, dtype=self.dtype, windows=self.limits.windows)
            detector = load_detector(artifact, scorer=scorers[key])
            if self.limits.min_span_confidence is not None:
                detector.min_span_confidence = self.limits.min_span_confidence
            self.pipelines[name] = Pipeline(detector)
            scorers[key].model  # noqa: B018 - load the model now, not on the first request
        if self.limits.batch_size is None:
            device = next(iter(scorers.values())).model.device.type
            self.batch_size = BATCH_SIZE.get(device, 8)
        for scorer in scorers.values():
            scorer.batch_size = self.batch_size  # a batch of the batcher is one forward pass
        self.warm_up()

    def warm_up(self) -> None:
        """Score the example with every detector, so that the first request does not pay for the first pass, and
        measure it and a longer answer (:data:`WARM_UP_SENTENCES` times its response), so that admission control
        starts from the slower of two measured seconds-per-token. Measured on one short answer alone, a flood of
        100-token answers ran 27-46 % slower per token than estimated, past the margin :class:`Worker` leaves."""
        for pipeline in self.pipelines.values():
            jobs = []
            for sentences in (1, WARM_UP_SENTENCES):
                item = {**EXAMPLE, "response": " ".join([EXAMPLE["response"]] * sentences)}
                jobs.append(_Job(pipeline, pipeline.encode([ScoreItem.model_validate(item).sample(0)])[0]))
            self.compute(jobs[:1])  # cold: first launches, the capture's check; not what a request will cost
            for job in jobs:
                t0 = time.perf_counter()
                self.compute([job])
                self.worker.measured(job.cost, time.perf_counter() - t0)

    def describe(self) -> list[dict]:
        out = []
        for name, pipeline in self.pipelines.items():
            det = pipeline.detector
            per_task = ({"thresholds": det.thresholds, "priors": {t: p.assumed_prior() for t, p in det.parts.items()}}
                        if det.name == "routed" else {"prior": det.assumed_prior()})
            out.append({"name": name, "method": det.name, "citation": det.citation, "default": name == self.default,
                        "threshold": det.threshold, **per_task, **det.identity,
                        "scored_in": pipeline.scorer.identity()["dtype"], "fitted_on": det.fitted_on,
                        "settings": det.settings})
        return out

    def prepare(self, items: list[ScoreItem]) -> list[tuple[Pipeline, list]]:
        """``(pipeline, token views)`` of every item (one view, or the windows of a long context), or the refusal of
        the whole request naming the item."""
        prepared = []
        for i, item in enumerate(items):
            name = item.detector or self.default
            if name not in self.pipelines:
                raise ApiError(422, f"item {i}: detector {name!r} is not loaded here (loaded: "
                                    f"{', '.join(self.pipelines)})", "unknown_detector", f"[{i}].detector")
            pipeline = self.pipelines[name]
            try:
                views = pipeline.encode([item.sample(i)])[0]
            except InputError as exc:
                raise ApiError(422, f"item {i}: {exc.problem}", "invalid_item", f"[{i}]") from None
            prepared.append((pipeline, views))
        return prepared

    async def score_body(self, body, http_request=None) -> list[dict]:
        """The results of a /v1/score body (one item object, or a list of them) as a list."""
        return await self.score(parse_items(body), http_request)

    async def score(self, items: list[ScoreItem], http_request=None) -> list[dict]:
        """The results of ``items``, or a refusal: tokenized off the event loop, admitted by their tokens, and
        dropped from the queue when the client of ``http_request`` goes away."""
        if len(items) > self.limits.max_items:
            raise ApiError(422, f"{len(items)} items in one request: the limit is {self.limits.max_items}",
                           "too_many_items")
        self.worker.check(len(items) * ANSWER_OVERHEAD_TOKENS)  # a busy server refuses before it tokenizes
        loop = asyncio.get_running_loop()
        prepared = await loop.run_in_executor(self.tokenizing, self.prepare, items)
        now = loop.time()
        jobs = [_Job(pipeline, views, item.min_span_confidence, item.evidence, future=loop.create_future(),
                     queued_at=now)
                for (pipeline, views), item in zip(prepared, items)]
        cost = sum(job.cost for job in jobs)
        facts = http_request.scope.get("halwatch", {}) if http_request is not None else {}
        facts.update(items=len(jobs), tokens=sum(job.tokens for job in jobs))
        self.worker.admit(cost)
        for job in jobs:
            job.future.add_done_callback(lambda _, c=job.cost: self.worker.release(c))
            self.queue.put_nowait(job)

        def give_up():
            for job in jobs:
                job.future.cancel()

        watch = asyncio.ensure_future(watch_disconnect(http_request, give_up)) if http_request is not None else None
        gathered = asyncio.gather(*(j.future for j in jobs))
        gathered.add_done_callback(lambda f: f.cancelled() or f.exception())  # a cancelled request's: retrieved
        try:
            return await asyncio.wait_for(gathered, self.worker.deadline)
        except asyncio.TimeoutError:
            give_up()
            raise ApiError(504, f"not scored within {self.worker.deadline:g} s", "timeout") from None
        except ApiError:  # one answer refused (shed): its request's other answers are not scored either
            give_up()
            raise
        finally:
            if watch is not None:
                watch.cancel()
            facts.update(queue_wait_s=round(max(j.waited for j in jobs), 4),
                         compute_s=round(max(j.computed for j in jobs), 4))

    async def batcher(self) -> None:
        """Take queued answers into batches and score each batch on the model thread, until cancelled. Answers
        wait in arrival order; each batch holds the oldest one and the waiting answers nearest to it in length
        (:func:`pick_batch`), so a batch pads little and no answer waits behind a stream of later ones."""
        loop = asyncio.get_running_loop()
        pending: list[_Job] = []
        limits = self.limits
        while True:
            if not pending:
                pending.append(await self.queue.get())
            deadline = loop.time() + limits.batch_wait
            while True:
                while not self.queue.empty():
                    pending.append(self.queue.get_nowait())
                left = deadline - loop.time()
                if len(pending) >= self.batch_size or left <= 0:
                    break
                try:
                    pending.append(await asyncio.wait_for(self.queue.get(), left))
                except asyncio.TimeoutError:
                    break
            pending = self.shed([j for j in pending if not j.future.done()], loop.time())  # (done: gone)
            if not pending:
                continue
            chosen = pick_batch([j.tokens for j in pending], self.batch_size, limits.batch_tokens,
                                limits.batch_padding)
            batch = [pending[i] for i in chosen]
            taken = set(chosen)
            pending = [j for i, j in enumerate(pending) if i not in taken]
            started = loop.time()
            for job in batch:
                job.waited = started - job.queued_at
            try:
                results = await self.worker.run(self.compute, batch)
            except Exception as exc:  # noqa: BLE001 - every waiting request gets the error
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(exc)
                continue
            elapsed = loop.time() - started
            self.worker.measured(sum(job.cost for job in batch), elapsed)
            for job, result in zip(batch, results):
                job.computed = elapsed
                if self.on_job is not None:
                    self.on_job(job, result)
                if not job.future.done():
                    job.future.set_result(result)

    def shed(self, pending: list[_Job], now: float) -> list[_Job]:
        """``pending`` less the answers that would now be done past the deadline (:meth:`Worker.overdue`): each
        of those is refused, 429 with ``Retry-After``, and its request with it (:meth:`score`)."""
        late = self.worker.overdue([(j.cost, j.queued_at) for j in pending], now)
        for i, answered in late.items():
            err = ApiError(429, f"the server is busy: admitted, this request would now be answered in about "
                                f"{answered:.1f} s, past the {self.worker.deadline:g} s limit (the model runs slower "
                                f"than estimated): retry later", "queue_full",
                           headers=self.worker.retry_after(self.worker.wait()))
            pending[i].future.set_exception(err)
            pending[i].future.exception()  # retrieved: its request raises the first of its answers' errors
        return [j for i, j in enumerate(pending) if i not in late]

    def compute(self, batch: list[_Job]) -> list[dict]:
        """One batch on the model thread (:func:`halwatch.pipeline.score_jobs`): one padded forward pass per scorer,
        asking for the merged signals of the detectors that share it; then each answer's verdict from its own
        detector."""
        self.batch_sizes.append(len(batch))
        if self.on_batch is not None:
            self.on_batch(len(batch))
        return [result.model_dump(exclude={"evidence"} if result.evidence is None else None)
                for result in score_jobs(batch)]

    async def check(self, query: str) -> dict:
        """HalMit's verdict for ``query`` against the configured store, on the model thread (a local target
        shares the scoring model when it is the same one)."""
        from halwatch.watchdog.run import check

        if not self.watch:
            raise ApiError(404, "no HalMit store is configured here (halwatch serve --watch-store STORE)",
                           "no_watch_store")
        target = self.watch.get("target") or "local:smollm2-135m"
        loaded = {p.scorer.model.name: p.scorer.model for p in self.pipelines.values()}
        options = {"scoring_model": loaded[target[6:]]} if target.removeprefix("local:") in loaded else {}
        cost = WATCH_CHECK_TOKENS
        self.worker.admit(cost)
        try:
            return await self.worker.run(lambda: check(query, self.watch["store"], target, client_options=options))
        except HalwatchError as exc:
            raise ApiError(400, str(exc), "watch_error") from None
        finally:
            self.worker.release(cost)


#: What one HalMit check costs the worker, in tokens of scoring (it samples a few short answers).
WATCH_CHECK_TOKENS = 2048


def build_app(detectors: list[str], api_key: str | None = None, limits: Limits | None = None,
              max_body_bytes: int = 4 << 20, upstream: str | None = None, upstream_key: str | None = None,
              watch: dict | None = None, models: dict | None = None, device: str = "auto", dtype: str = "auto",
              stream_policy: str = "annotate", check_every: int = 16):
    """The service app, loading ``detectors`` (shipped names or artifact files; the first is the default) at
    start-up; ready once they are loaded. ``upstream``: an OpenAI-compatible base URL for the guard proxy.
    ``models``: scoring models already loaded in this process, by name, to use instead of loading them again;
    ``device`` and ``dtype``: where and in which precision the others load."""
    from contextlib import asynccontextmanager

    from halwatch.serve.page import add_page

    service = ScoringService(detectors, limits, watch, models, device=device, dtype=dtype)
    state = ServerState(name="halwatch serve")

    @asynccontextmanager
    async def lifespan(app):
        from concurrent.futures import ThreadPoolExecutor

        await service.worker.run(service.load)  # on the model thread, as every batch later (Worker.run says why)
        service.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="halwatch-tokenize")
        service.queue = asyncio.Queue()
        task = asyncio.create_task(service.batcher())
        guard = None
        if upstream:
            from halwatch.serve.guard import Guard

            guard = app.state.guard = Guard(upstream, upstream_key, service, stream_policy=stream_policy,
                                            check_every=check_every)
        state.ready = True
        yield
        state.ready = False
        task.cancel()
        if guard is not None:
            await guard.aclose()
        service.worker.close()
        service.tokenizing.shutdown(wait=False, cancel_futures=True)

    app = create_app(state, api_key=api_key, max_body_bytes=max_body_bytes, lifespan=lifespan,
                     title="halwatch serve", summary="Is an answer supported by its context, and which words are not")
    _add_metrics(service, state)
    _add_routes(app, service, watch=bool(watch), upstream=bool(upstream))
    add_page(app)
    app.state.service = service
    app.state.started_at = time.time()
    return app


def _add_metrics(service: ScoringService, state: ServerState) -> None:
    """The service's Prometheus metrics (batch sizes, queued tokens, the measured rate, waits, compute times,
    verdicts), fed by the service's ``on_batch`` and ``on_job`` hooks."""
    from prometheus_client import Counter, Gauge, Histogram

    batch_sizes = Histogram("halwatch_batch_size", "Answers per forward batch", registry=state.registry,
                            buckets=(1, 2, 4, 8, 16, 32, 64))
    service.on_batch = batch_sizes.observe
    Gauge("halwatch_queued_tokens", "Tokens of answers admitted and not yet scored", registry=state.registry
          ).set_function(lambda: service.worker.queued)
    Gauge("halwatch_seconds_per_token", "Measured model time per queued token (admission control's estimate)",
          registry=state.registry).set_function(lambda: service.worker.rate or 0.0)
    seconds = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
    waits = Histogram("halwatch_queue_wait_seconds", "Time an answer waited for the model", registry=state.registry,
                      buckets=seconds)
    computes = Histogram("halwatch_compute_seconds", "Time of the forward batch that scored an answer",
                         registry=state.registry, buckets=seconds)
    verdicts = Counter("halwatch_verdicts", "Answers scored, by detector and verdict", ["detector", "verdict"],
                       registry=state.registry)

    def observe(job, result):
        waits.observe(job.waited)
        computes.observe(job.computed)
        verdicts.labels(result["detector"], "hallucinated" if result["hallucinated"] else "supported").inc()

    service.on_job = observe


def _add_routes(app, service: ScoringService, watch: bool, upstream: bool) -> None:
    """The scoring routes: /v1/score, /v1/detectors, /v1/watch/check and the guard's /v1/chat/completions (the
    last two documented only where configured)."""
    ref = {"$ref": "#/components/schemas/ScoreItem"}
    body_schema = {"anyOf": [ref, {"type": "array", "items": ref, "minItems": 1,
                                   "maxItems": service.limits.max_items}]}

    def document_items(doc: dict) -> None:
        item = ScoreItem.model_json_schema(ref_template="#/components/schemas/{model}")
        item["properties"]["detector"] = {"anyOf": [{"enum": service.names}, {"type": "null"}],
                                          "description": item["properties"]["detector"].get("description", "")}
        doc["components"]["schemas"]["ScoreItem"] = item

    app.state.openapi_patches.append(document_items)

    @app.post("/v1/score", response_model=Result | list[Result], response_model_exclude_unset=True,
              responses=errors(413, 422, 429, 504),
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": body_schema, "example": EXAMPLE}}}})
    async def score(request: Request):
        """Score one item (an object: a result comes back) or a list of items (a list of results, in order).
        Refused at once with 429 and Retry-After when it cannot be answered within the server's time limit."""
        body = await read_json(request)
        results = await service.score_body(body, request)
        return results if isinstance(body, list) else results[0]

    @app.get("/v1/detectors", response_model=DetectorList, responses=errors())
    async def detectors_route():
        """The loaded detectors, the default first, with what each was fitted on."""
        return {"default": service.default, "detectors": service.describe()}

    @app.post("/v1/watch/check", response_model=WatchVerdict, responses=errors(404, 422, 429),
              include_in_schema=watch)
    async def watch_check(body: WatchQuery):
        """HalMit (Algorithm 1): is this query likely to make the watched agent hallucinate?"""
        return await service.check(body.query)

    @app.post("/v1/chat/completions", responses=errors(404, 413, 422, 429, 502, 504), include_in_schema=upstream,
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": {
                  "type": "object", "required": ["messages"], "properties": {
                      "messages": {"type": "array", "minItems": 1, "items": {"type": "object"}},
                      "halwatch_context": {"anyOf": [{"type": "string"}, {"type": "array",
                                                                          "items": {"type": "string"}}]},
                      "halwatch_stream_policy": {"enum": list(STREAM_POLICIES)},
                      "halwatch_check_every": {"type": "integer", "minimum": 1}}}}}}})
    async def chat(request: Request):
        """The guard: the chat completion of the upstream LLM, with the verdict on its answer (``halwatch``)."""
        guard = getattr(app.state, "guard", None)
        if guard is None:
            raise ApiError(404, "no upstream LLM is configured here (halwatch serve --upstream URL)", "no_upstream")
        return await guard.handle(request)
