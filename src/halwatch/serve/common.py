"""What every halwatch HTTP server shares (``halwatch serve`` and ``halwatch watch serve-llm``): one FastAPI +
pydantic + uvicorn stack with

- errors as OpenAI-style objects, ``{"error": {"message", "type", "param", "code"}}``, with the right status, for
  our own refusals, malformed or invalid requests (400 / 422), unknown routes (404), and anything unexpected (500);
- a request-body limit checked before the body is read (413, or 400 for a bad ``Content-Length``);
- an optional API key from an environment variable, accepted as ``Authorization: Bearer KEY`` or ``X-API-Key``,
  compared in constant time (401);
- ``GET /health/live``, ``GET /health/ready`` (ready once the models are loaded, not while draining) and Prometheus
  ``GET /metrics`` (requests, latency, errors, plus what each server adds);
- a refusal to listen beyond loopback without a key unless asked (``--insecure``), and a graceful stop: on SIGTERM
  the server reports not ready, finishes the requests in flight, then exits.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from dataclasses import dataclass, field

from halwatch.errors import HalwatchError
from halwatch.net import env_secret, loopback

log = logging.getLogger("halwatch")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error",
               504: "timeout_error"}


def add_server_options(parser, port: int, timeout: float = 300.0, queue_size: int = 16,
                       max_body_bytes: int = 1 << 20) -> None:
    """The command-line options every halwatch server takes."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback)")
    parser.add_argument("--port", type=int, default=port, help=f"port (default {port}; 0 = a free one)")
    parser.add_argument("--api-key-env", metavar="VAR",
                        help="require the API key in this environment variable (Authorization: Bearer KEY or "
                             "X-API-Key: KEY)")
    parser.add_argument("--insecure", action="store_true",
                        help="allow listening beyond loopback without an API key")
    parser.add_argument("--queue-size", type=int, default=queue_size,
                        help=f"requests that may wait for the model; more are answered 429 (default {queue_size})")
    parser.add_argument("--timeout", type=float, default=timeout,
                        help=f"seconds a request may take before it is answered 504 (default {timeout:.0f})")
    parser.add_argument("--max-body-bytes", type=int, default=max_body_bytes,
                        help=f"largest request body; larger ones are answered 413 (default {max_body_bytes >> 20} "
                             f"MiB)")


class ApiError(Exception):
    """A refusal with its HTTP status and a message for people (and an OpenAI-style ``code`` and ``param``)."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}


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
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(lifespan=lifespan, **fastapi_options)
    app.state.server = state
    registry = state.registry = CollectorRegistry()
    state.metrics.update(
        requests=Counter("halwatch_requests", "HTTP requests answered", ["route", "status"], registry=registry),
        latency=Histogram("halwatch_request_seconds", "Time to answer a request", ["route"], registry=registry,
                          buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)),
        errors=Counter("halwatch_errors", "Requests answered with an error status", ["route", "status"],
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
        message = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
                   else str(exc.detail))
        return reply(exc.status_code, message)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return reply(500, f"internal error: {type(exc).__name__}")

    app.add_middleware(_Guard, owner=app, max_body_bytes=max_body_bytes, api_key=api_key)

    @app.get("/health/live", include_in_schema=False)
    async def live():
        return {"status": "alive", "uptime_s": round(time.time() - state.started, 1)}

    @app.get("/health/ready", include_in_schema=False)
    async def ready():
        if state.ready and not state.draining:
            return {"status": "ready"}
        return JSONResponse({"status": "draining" if state.draining else "loading"}, status_code=503)

    @app.get("/metrics", include_in_schema=False)
    async def metrics():
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    return app


class _Guard:
    """Pure ASGI middleware in front of every route: refuses a bad or oversized ``Content-Length`` and a missing or
    wrong API key before the body is read, counts the bytes of a body sent without a length (chunked) and stops it
    past the limit, and records each request's route, status and latency."""

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
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return 400, f"bad Content-Length {length!r}", "bad_content_length"
            if int(length) > self.limit:
                return 413, f"request body of {length} bytes is over the limit of {self.limit} bytes", "body_too_large"
        if self.key is not None and not path.startswith("/health"):
            given = headers.get("x-api-key") or ""
            auth = headers.get("authorization") or ""
            if not given and auth.lower().startswith("bearer "):
                given = auth[7:].strip()
            if not hmac.compare_digest(given.encode(), self.key.encode()):
                return 401, "missing or wrong API key (Authorization: Bearer KEY or X-API-Key: KEY)", "invalid_api_key"
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        import json

        path, t0, status = scope["path"], time.perf_counter(), [500]
        route = self.route(path)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        refused = self.refusal(headers, path)
        try:
            if refused is not None:
                code, message, err = refused
                body = json.dumps(error_body(code, message, err)).encode()
                await sending({"type": "http.response.start", "status": code,
                               "headers": [(b"content-type", b"application/json"),
                                           (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": body})
                return
            seen = [0]

            async def receiving():
                message = await receive()
                if message["type"] == "http.request":
                    seen[0] += len(message.get("body", b""))
                    if seen[0] > self.limit:
                        raise ApiError(413, f"request body is over the limit of {self.limit} bytes", "body_too_large")
                return message

            await self.app(scope, receiving, sending)
        finally:
            metrics = self.owner.state.server.metrics
            metrics["requests"].labels(route, str(status[0])).inc()
            metrics["latency"].labels(route).observe(time.perf_counter() - t0)
            if status[0] >= 400:
                metrics["errors"].labels(route, str(status[0])).inc()


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


def serve(app, host: str, port: int, on_started=None, drain_seconds: float = 30.0) -> None:
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


class Worker:
    """The one thread that runs a server's model work, in the order it comes, with admission control: at most
    ``queue_size`` units of work (requests, or scored answers) may be admitted at a time, and more are refused with
    429 and ``Retry-After`` (backpressure, not an unbounded backlog). :attr:`waiting` is the queue depth."""

    def __init__(self, queue_size: int, retry_after: int = 1):
        from concurrent.futures import ThreadPoolExecutor

        if queue_size < 1:
            raise HalwatchError(f"the queue size must be at least 1, got {queue_size}")
        self.queue_size, self.retry_after = queue_size, retry_after
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="halwatch-model")
        self.waiting = 0

    def admit(self, n: int = 1) -> None:
        """Count ``n`` more units in, or refuse them all (429) when they do not fit the queue."""
        if self.waiting + n > self.queue_size:
            raise ApiError(429, f"the server is busy ({self.waiting} queued, the limit is {self.queue_size}): "
                                f"retry later", "queue_full", headers={"Retry-After": str(self.retry_after)})
        self.waiting += n

    def release(self, n: int = 1) -> None:
        self.waiting -= n

    async def run(self, fn, *args):
        """``fn(*args)`` on the model thread; its result."""
        import asyncio

        return await asyncio.wrap_future(self.pool.submit(fn, *args))

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
