"""What every halwatch HTTP server shares (``halwatch serve`` and ``halwatch watch serve-llm``): one FastAPI +
pydantic + uvicorn stack with

- errors as OpenAI-style objects, ``{"error": {"message", "type", "param", "code"}}``, with the right status, for
  our own refusals, malformed or invalid requests (400 / 422), unknown routes (404), and anything unexpected (500);
- a request-body limit checked before the body is read (413, or 400 for a bad ``Content-Length``), and held for
  bodies sent without a length (chunked);
- an optional API key from an environment variable, accepted as ``Authorization: Bearer KEY`` or ``X-API-Key``,
  compared in constant time (401 with ``WWW-Authenticate``); the page, ``/docs`` and the probes need none;
- admission control by the tokens of model work (:class:`Worker`): refused at once (429 with ``Retry-After``)
  rather than left to time out;
- an access log, one JSON line per request (:func:`configure_access_log`);
- ``GET /health/live``, ``GET /health/ready`` (ready once the models are loaded, not while draining) and Prometheus
  ``GET /metrics`` (requests, latency, errors, plus what each server adds);
- a refusal to listen beyond loopback without a key unless asked (``--insecure``), and a graceful stop: on SIGTERM
  the server reports not ready, refuses new requests (503), answers every request already admitted (at most
  ``--drain-timeout`` seconds), then exits.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import math
import threading
import time
from dataclasses import dataclass, field

from pydantic import BaseModel, Field

from halwatch.errors import HalwatchError
from halwatch.net import env_secret, loopback

log = logging.getLogger("halwatch")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error",
               504: "timeout_error"}


def add_server_options(parser, port: int, timeout: float = 300.0, queue_tokens: int = 32768,
                       max_body_bytes: int = 1 << 20) -> None:
    """The command-line options every halwatch server takes."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback)")
    parser.add_argument("--port", type=int, default=port, help=f"port (default {port}; 0 = a free one)")
    parser.add_argument("--api-key-env", metavar="VAR",
                        help="require the API key in this environment variable (Authorization: Bearer KEY or "
                             "X-API-Key: KEY) for the API; the page, /docs and the health probes stay open")
    parser.add_argument("--insecure", action="store_true",
                        help="allow listening beyond loopback without an API key")
    parser.add_argument("--queue-tokens", type=int, default=queue_tokens,
                        help=f"tokens of model work that may be queued (default {queue_tokens}); a request that "
                             f"does not fit now is answered 429 with Retry-After, one larger than the whole queue "
                             f"413")
    parser.add_argument("--timeout", type=float, default=timeout,
                        help=f"seconds a request may take (default {timeout:.0f}): a request whose estimated wait "
                             f"is longer is refused at once (429), one that still overruns is answered 504")
    parser.add_argument("--drain-timeout", type=float, default=None, metavar="SECONDS",
                        help="on SIGTERM, how long the requests already admitted may take to finish (default: "
                             "--timeout)")
    parser.add_argument("--max-body-bytes", type=int, default=max_body_bytes,
                        help=f"largest request body; larger ones are answered 413 (default {max_body_bytes >> 20} "
                             f"MiB)")
    parser.add_argument("--access-log", default="-", metavar="PATH|-|off",
                        help="one JSON line per request (method, route, status, items, tokens, queue wait, compute; "
                             "never the texts) to PATH, to stderr (-, the default) or nowhere (off)")


class ApiError(Exception):
    """A refusal with its HTTP status and a message for people (and an OpenAI-style ``code`` and ``param``)."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}


class ErrorDetail(BaseModel):
    """What went wrong, OpenAI-style."""

    message: str = Field(description="what went wrong, for people")
    type: str = Field(description="the kind of error (invalid_request_error, authentication_error, "
                                  "rate_limit_error, timeout_error, server_error, not_found_error)")
    param: str | None = Field(None, description="the field at fault, where there is one")
    code: str | None = Field(None, description="a stable code for programs")


class ErrorBody(BaseModel):
    """Every error of every route has this shape."""

    error: ErrorDetail


class Status(BaseModel):
    status: str = Field(description="alive, ready, loading or draining")
    uptime_s: float | None = None


#: What each error status means, as every route documents it.
ERROR_STATUSES = {
    400: "malformed request: a body that is not JSON, a bad Content-Length",
    401: "missing or wrong API key (when the server has one)",
    404: "nothing configured here for this route",
    413: "request body, item count or model work over the server's limits",
    422: "a field is missing or invalid; the message names it",
    429: "busy: the request cannot be answered within the time limit now; retry after Retry-After seconds",
    500: "an unexpected error",
    502: "the upstream LLM cannot be reached",
    503: "the server is loading or shutting down; retry after Retry-After seconds",
    504: "not answered within --timeout",
}
_HEADERS = {
    401: {"WWW-Authenticate": {"schema": {"type": "string"}, "description": "Bearer realm=\"halwatch\""}},
    429: {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds to wait before retrying"}},
    503: {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds to wait before retrying"}},
}
#: The errors any route can answer (the guard in front of every route, and the error handler).
COMMON_ERRORS = (400, 401, 413, 500, 503)


def errors(*statuses: int) -> dict:
    """The ``responses`` of a route: ``statuses`` and :data:`COMMON_ERRORS`, each with :class:`ErrorBody`."""
    return {s: {"model": ErrorBody, "description": ERROR_STATUSES[s], **({"headers": _HEADERS[s]} if s in _HEADERS
                                                                          else {})}
            for s in sorted(set(statuses) | set(COMMON_ERRORS))}


#: How the guard proxy may treat a streamed answer (``halwatch.serve.guard``); here so that the command line can
#: offer them without importing the proxy.
STREAM_POLICIES = ("annotate", "hold", "stop")


async def read_json(request):
    """The JSON body of a route that reads its own body, or a 400."""
    import json

    try:
        return json.loads(await request.body())
    except ValueError:
        raise ApiError(400, "the request body is not valid JSON (UTF-8)", "invalid_json") from None


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


@dataclass
class ServerState:
    """What the health and metrics routes report: set ``ready`` once the models are loaded."""

    name: str
    ready: bool = False
    draining: bool = False
    started: float = field(default_factory=time.time)
    registry: object = None
    metrics: dict = field(default_factory=dict)


def api_key_from(env_var: str | None) -> str | None:
    """The API key in ``$env_var`` (``None`` without a variable); an unset or empty variable is an error."""
    return env_secret(env_var, "--api-key-env")


def check_bind(host: str, api_key: str | None, insecure: bool) -> None:
    """Refuse to listen beyond loopback without an API key unless ``insecure``; warn when listening beyond it."""
    if loopback(host):
        return
    if api_key is None and not insecure:
        raise HalwatchError(f"refusing to listen on {host} without an API key: give --api-key-env VAR, or "
                            f"--insecure to serve anyone who can reach this address")
    log.warning("listening on %s: reachable beyond this machine%s", host,
                "" if api_key else ", WITHOUT an API key (--insecure)")


def create_app(state: ServerState, api_key: str | None = None, max_body_bytes: int = 1 << 20, lifespan=None,
               invalid_status: int = 422, **fastapi_options):
    """A FastAPI app with the shared pieces: error handlers, body limit, auth, health, metrics and request
    metrics. The caller adds its routes and sets ``state.ready`` when its models are loaded. A request whose fields
    fail validation is answered ``invalid_status`` (422; the OpenAI API answers 400)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(lifespan=lifespan, **fastapi_options)
    app.state.server = state
    app.state.openapi_patches = []  # callables that edit the OpenAPI document once it is built

    def openapi():
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            _document_security(doc, api_key is not None)
            for patch in app.state.openapi_patches:
                patch(doc)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
    registry = state.registry = CollectorRegistry()
    state.metrics.update(
        requests=Counter("halwatch_requests", "HTTP requests answered", ["route", "status"], registry=registry),
        latency=Histogram("halwatch_request_seconds", "Time to answer a request", ["route"], registry=registry,
                          buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)),
        errors=Counter("halwatch_errors", "Requests answered with an error status", ["route", "status"],
                       registry=registry),
        in_flight=Gauge("halwatch_requests_in_flight", "Requests received and not yet answered", ["route"],
                        registry=registry),
    )

    def reply(status: int, message: str, code=None, param=None, headers=None):
        return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return reply(exc.status, exc.message, exc.code, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        problems = exc.errors()
        if any(p.get("type") == "json_invalid" for p in problems):
            return reply(400, "the request body is not valid JSON (UTF-8)", "invalid_json")
        first = problems[0] if problems else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        return reply(invalid_status, f"{where or 'body'}: {first.get('msg', 'invalid')}{more}", "invalid_value",
                     where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        allowed = (getattr(exc, "headers", None) or {}).get("Allow")
        message = (f"no route {request.method} {request.url.path}" if exc.status_code == 404
                   else f"{request.method} is not allowed on {request.url.path} (allowed: {allowed})"
                   if exc.status_code == 405 else str(exc.detail))
        return reply(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return reply(500, f"internal error: {type(exc).__name__}")

    app.add_middleware(_Guard, owner=app, max_body_bytes=max_body_bytes, api_key=api_key)

    @app.get("/health/live", response_model=Status, response_model_exclude_none=True, responses=errors(),
             tags=["health"])
    async def live():
        """Liveness: the process answers."""
        return {"status": "alive", "uptime_s": round(time.time() - state.started, 1)}

    @app.get("/health/ready", response_model=Status, response_model_exclude_none=True, responses={**errors(), 503: {
        "model": Status, "description": "loading the models, or draining before a stop"}}, tags=["health"])
    async def ready():
        """Readiness: 200 once the models are loaded, 503 while loading and from SIGTERM on."""
        if state.ready and not state.draining:
            return {"status": "ready"}
        return JSONResponse({"status": "draining" if state.draining else "loading"}, status_code=503)

    @app.get("/metrics", responses={**errors(), 200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                                                      "description": "Prometheus text format"}}, tags=["health"])
    async def metrics():
        """Prometheus metrics: requests, latency, errors, queue wait and compute, verdicts."""
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    return app


#: Paths that need no API key: the health probes, the page and its files, and the API's own documentation (a
#: browser cannot send a key to load them; the page asks for the key and sends it with its API calls).
OPEN_PATHS = ("/health/", "/static/")
OPEN_ROUTES = {"/", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}

access_log = logging.getLogger("halwatch.access")


def configure_access_log(where: str | None) -> None:
    """Send the access log (one JSON line per request) to ``where``: a file path, ``-`` for stderr, or ``off``."""
    access_log.handlers.clear()
    access_log.propagate = False
    if where in (None, "off"):
        access_log.setLevel(logging.CRITICAL + 1)
        return
    handler = logging.StreamHandler() if where == "-" else logging.FileHandler(where, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(message)s"))
    access_log.addHandler(handler)
    access_log.setLevel(logging.INFO)


def _document_security(doc: dict, required: bool) -> None:
    """The API-key scheme in the OpenAPI document (bearer or ``X-API-Key``), required on every route that is not
    open (:data:`OPEN_ROUTES`, :data:`OPEN_PATHS`) when the server has a key."""
    doc.setdefault("components", {})["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer", "description": "Authorization: Bearer KEY"},
        "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"}}
    for path, operations in doc.get("paths", {}).items():
        for operation in operations.values():
            operation["security"] = [{"bearer": []}, {"apiKey": []}] if required and not _open(path) else []


def _open(path: str) -> bool:
    return path in OPEN_ROUTES or path.startswith(OPEN_PATHS)


class _Guard:
    """Pure ASGI middleware in front of every route: refuses a bad or oversized ``Content-Length`` and a missing or
    wrong API key before the body is read, and every request but the probes while the server drains (503); reads a
    body sent without a length (chunked) up to the limit (413 past it) before the route sees it; records each
    request's route, status and latency, and writes the access-log line."""

    def __init__(self, app, owner, max_body_bytes: int, api_key: str | None):
        self.app, self.owner, self.limit, self.key = app, owner, max_body_bytes, api_key
        self.paths: set[str] | None = None

    def route(self, path: str) -> str:
        """The metrics label of a path: the path of one of the app's routes, else ``other`` (so that requests for
        random paths cannot grow the metrics without bound)."""
        if self.paths is None:
            self.paths = {getattr(r, "path", "") for r in self.owner.routes}
        return path if path in self.paths else "other"

    def refusal(self, headers: dict, path: str):
        """``(status, message, code, extra headers)`` of a request refused before its body is read, or ``None``."""
        if self.owner.state.server.draining and not path.startswith("/health/"):
            return 503, "the server is shutting down: retry on another instance", "draining", {"Retry-After": "1"}
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return 400, f"bad Content-Length {length!r}", "bad_content_length", {}
            if int(length) > self.limit:
                return (413, f"request body of {length} bytes is over the limit of {self.limit} bytes (--max-body-"
                             f"bytes)", "body_too_large", {})
        if self.key is not None and not _open(path):
            given = headers.get("x-api-key") or ""
            auth = headers.get("authorization") or ""
            if not given and auth.lower().startswith("bearer "):
                given = auth[7:].strip()
            if not hmac.compare_digest(given.encode(), self.key.encode()):
                return (401, "missing or wrong API key (Authorization: Bearer KEY or X-API-Key: KEY)",
                        "invalid_api_key", {"WWW-Authenticate": 'Bearer realm="halwatch"'})
        return None

    async def _read_chunked(self, receive):
        """The whole body of a request without ``Content-Length``, or ``None`` when it passes the limit."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return [message]
            size += len(message.get("body", b""))
            if size > self.limit:
                return None
            chunks.append(message)
            if not message.get("more_body"):
                return chunks

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        import json

        path, t0, status = scope["path"], time.perf_counter(), [500]
        route = self.route(path)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        scope["halwatch"] = facts = {}  # what a route adds to its access-log line (items, tokens, timings)

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        async def refuse(code, message, err, extra):
            body = json.dumps(error_body(code, message, err)).encode()
            head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")] + [(k.lower().encode(), v.encode()) for k, v in extra.items()]
            await sending({"type": "http.response.start", "status": code, "headers": head})
            await send({"type": "http.response.body", "body": body})

        metrics = self.owner.state.server.metrics
        metrics["in_flight"].labels(route).inc()
        try:
            refused = self.refusal(headers, path)
            if refused is not None:
                return await refuse(*refused)
            if "content-length" not in headers and scope.get("method") in ("POST", "PUT", "PATCH"):
                messages = await self._read_chunked(receive)
                if messages is None:
                    return await refuse(413, f"request body is over the limit of {self.limit} bytes "
                                             f"(--max-body-bytes)", "body_too_large", {})

                async def replay():
                    return messages.pop(0) if messages else await receive()

                return await self.app(scope, replay, sending)
            await self.app(scope, receive, sending)
        finally:
            elapsed = time.perf_counter() - t0
            metrics["in_flight"].labels(route).dec()
            metrics["requests"].labels(route, str(status[0])).inc()
            metrics["latency"].labels(route).observe(elapsed)
            if status[0] >= 400:
                metrics["errors"].labels(route, str(status[0])).inc()
            if access_log.isEnabledFor(logging.INFO):
                access_log.info(json.dumps({"time": round(time.time(), 3), "method": scope.get("method"),
                                            "route": route, "status": status[0], "seconds": round(elapsed, 4),
                                            **facts}))


def _uvicorn_server(app, host: str, port: int, drain_seconds: float, on_started=None):
    """A uvicorn server for ``app`` whose SIGTERM / SIGINT first marks the app not ready (then uvicorn stops
    accepting connections and waits for the requests in flight, at most ``drain_seconds``)."""
    import uvicorn

    state: ServerState = app.state.server

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            state.draining = True
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started and on_started is not None:
                on_started(*self.servers[0].sockets[0].getsockname()[:2])

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=drain_seconds,
                            lifespan="on")
    return Server(config)


def serve(app, host: str, port: int, on_started=None, drain_seconds: float = 120.0) -> None:
    """Run ``app`` until SIGINT or SIGTERM; ``on_started(host, port)`` once it listens (port 0: a free one)."""
    _uvicorn_server(app, host, port, drain_seconds, on_started).run()


class Running:
    """A server running in a thread of this process (tests, and a guard's upstream in one process): ``url`` is
    ``http://HOST:PORT``; :meth:`stop` drains and stops it."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, drain_seconds: float = 10.0,
                 start_timeout: float = 120.0):
        bound = threading.Event()
        self.address = None

        def started(h, p):
            self.address = (h, p)
            bound.set()

        self.server = _uvicorn_server(app, host, port, drain_seconds, started)
        self.server.config.install_signal_handlers = False  # a thread cannot own signals
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        if not bound.wait(start_timeout) or self.address is None:
            raise HalwatchError(f"the server did not start on {host}:{port}")
        self.url = f"http://{self.address[0]}:{self.address[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


async def watch_disconnect(http_request, on_gone, every: float = 0.25) -> None:
    """Call ``on_gone()`` when the client of a plain (not streamed) request disconnects; cancel this task when the
    answer is ready."""
    while True:
        if await http_request.is_disconnected():
            on_gone()
            return
        await asyncio.sleep(every)


class Worker:
    """The one thread that runs a server's model work, in the order it comes, with admission control by cost (tokens
    of model work): a request is admitted only when it fits the queue (``capacity``) and, by the seconds per token
    measured on finished work, can be answered within ``deadline`` seconds; otherwise it is refused at once, 429
    with an honest ``Retry-After`` (when the queue ahead will have drained enough), or 413 when it is larger than
    the whole queue. :attr:`queued` is the cost admitted and not yet finished."""

    #: The share of the time limit the estimated model time may fill: the rest is for what the estimate does not
    #: see (tokenizing, the event loop, a batch slower than the average).
    DEADLINE_SHARE = 0.8

    def __init__(self, capacity: int, deadline: float):
        from concurrent.futures import ThreadPoolExecutor

        if capacity < 1:
            raise HalwatchError(f"--queue-tokens must be at least 1, got {capacity}")
        self.capacity, self.deadline = capacity, deadline
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="halwatch-model")
        self.queued = 0
        self.recent: collections.deque = collections.deque(maxlen=self.RECENT)  # seconds per unit, measured

    #: How many finished batches the estimate reads: the slowest of them per unit of cost, so that one slow batch
    #: (a busy CPU, a long answer) is never averaged away into admitting work that then times out.
    RECENT = 8

    @property
    def rate(self) -> float | None:
        """Seconds per unit of cost: the slowest of the last :data:`RECENT` finished batches (``None`` before)."""
        return max(self.recent) if self.recent else None

    def wait(self, cost: int = 0) -> float | None:
        """Estimated seconds until ``cost`` more units admitted now would be done (``None`` before any measure)."""
        return None if self.rate is None else (self.queued + cost) * self.rate

    def admit(self, cost: int) -> None:
        """Count ``cost`` more units in, or refuse them (:meth:`check`)."""
        self.check(cost)
        self.queued += cost

    def check(self, cost: int) -> None:
        """Refuse ``cost`` more units: 413 when larger than the whole queue, 429 when they do not fit now or would
        finish past the deadline. (A lower bound of a request's cost can be checked before it is tokenized.)"""
        if cost > self.capacity:
            raise ApiError(413, f"this request needs {cost} tokens of model work, more than the whole queue "
                                f"holds ({self.capacity}, --queue-tokens): send fewer or shorter items",
                           "request_too_large")
        alone, budget = cost * (self.rate or 0.0), self.deadline * self.DEADLINE_SHARE
        if alone > budget:
            raise ApiError(413, f"this request needs about {alone:.1f} s of model time even on an idle server, "
                                f"past the {self.deadline:g} s limit (--timeout): send fewer or shorter items",
                           "request_too_large")
        wait = self.wait(cost)
        if self.queued + cost > self.capacity:
            behind = (self.queued + cost - self.capacity) * (self.rate or 0.0)
            raise ApiError(429, f"the server is busy ({self.queued} of {self.capacity} tokens queued): retry "
                                f"later", "queue_full", headers={"Retry-After": str(max(1, math.ceil(behind)))})
        if wait is not None and wait > budget:
            raise ApiError(429, f"the server is busy: this request would be answered in about {wait:.1f} s, past "
                                f"the {self.deadline:g} s limit: retry later", "queue_full",
                           headers=self.retry_after(wait))

    def retry_after(self, wait: float) -> dict:
        """The ``Retry-After`` header of a 429 for work that would be done in ``wait`` seconds: when it would
        fit the share of the deadline that admission allows."""
        return {"Retry-After": str(max(1, math.ceil(wait - self.deadline * self.DEADLINE_SHARE)))}

    def overdue(self, waiting: list[tuple[int, float]], now: float) -> dict[int, float]:
        """``{index: estimated seconds from its admission to done}`` for the admitted work still waiting
        (``(cost, admitted at)`` in the order it will run, nothing running ahead of it) that, at the seconds per
        unit measured by now, would be done past the share of the deadline that admission allows: work admitted
        on an estimate that the batches since have proved too low (a flood slows the model thread while the event
        loop parses it). Refused at once, it is a 429 the client can act on instead of a 504 later."""
        if self.rate is None:
            return {}
        ahead, late = 0, {}
        for i, (cost, since) in enumerate(waiting):
            answered = now + (ahead + cost) * self.rate - since
            if answered > self.deadline * self.DEADLINE_SHARE:
                late[i] = answered
            else:
                ahead += cost
        return late

    def release(self, cost: int) -> None:
        self.queued -= cost

    def measured(self, cost: int, seconds: float) -> None:
        """Fold the time of finished work of ``cost`` units into the seconds-per-unit estimate."""
        if cost > 0:
            self.recent.append(seconds / cost)

    async def run(self, fn, *args):
        """``fn(*args)`` on the model thread; its result. Everything that runs the model goes through here, loading
        and warming up included: torch's parallel work (OpenMP) on a second thread that stays alive slows every
        batch of the model thread by about 20 % on a CPU (docs/serving.md)."""
        return await asyncio.wrap_future(self.pool.submit(fn, *args))

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
