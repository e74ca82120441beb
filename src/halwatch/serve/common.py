"""What every halwatch HTTP server shares (``halwatch serve`` and ``halwatch watch serve-llm``): one FastAPI +
pydantic + uvicorn stack with

- errors as OpenAI-style objects, ``{"error": {"message", "type", "param", "code"}}``, with the right status, for
  our own refusals, malformed or invalid requests (400 / 422), unknown routes (404), and anything unexpected (500);
- a request-body limit checked before the body is read (413, or 400 for a bad ``Content-Length``), and held for
  bodies sent without a length (chunked);
- an optional API key from an environment variable, accepted as ``Authorization: Bearer KEY`` or ``X-API-Key``,
  compared in constant time (401 with ``WWW-Authenticate``); the page, ``/docs`` and the probes need none;
- admission control by the tokens of model work (:class:`halwatch.serve.worker.Worker`): refused at once (429
  with ``Retry-After``) rather than left to time out;
- an access log, one JSON line per request (:mod:`halwatch.serve.gate`);
- ``GET /health/live``, ``GET /health/ready`` (ready once the models are loaded, not while draining) and Prometheus
  ``GET /metrics`` (requests, latency, errors, plus what each server adds);
- a refusal to listen beyond loopback without a key unless asked (``--insecure``), and a graceful stop: on SIGTERM
  the server reports not ready, refuses new requests (503), answers every request already admitted (at most
  ``--drain-timeout`` seconds), then exits.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from pydantic import BaseModel, Field

from halwatch.errors import HalwatchError
from halwatch.net import env_secret, loopback
from halwatch.serve.gate import Gate, document_security, error_body

log = logging.getLogger("halwatch")


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
    from fastapi import FastAPI
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    app = FastAPI(lifespan=lifespan, **fastapi_options)
    app.state.server = state
    app.state.openapi_patches = []  # callables that edit the OpenAPI document once it is built

    def openapi():
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            document_security(doc, api_key is not None)
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

    _add_error_handlers(app, invalid_status)
    app.add_middleware(Gate, owner=app, max_body_bytes=max_body_bytes, api_key=api_key)
    _add_health_routes(app, state)
    return app


def _add_error_handlers(app, invalid_status: int) -> None:
    """Every error as an OpenAI-style body (:func:`halwatch.serve.gate.error_body`): our refusals (:class:`ApiError`),
    invalid JSON (400) and invalid fields (``invalid_status``), unknown routes and methods, anything unexpected."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

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


def _add_health_routes(app, state: ServerState) -> None:
    """``/health/live``, ``/health/ready`` and Prometheus ``/metrics`` (from ``state.registry``)."""
    from fastapi.responses import JSONResponse, PlainTextResponse
    from prometheus_client import generate_latest

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
        return PlainTextResponse(generate_latest(state.registry).decode(), media_type="text/plain; version=0.0.4")


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
