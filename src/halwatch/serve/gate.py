"""The ASGI gate in front of every route of a halwatch server (:func:`halwatch.serve.common.create_app`): body
limits, the API key, the drain, request metrics and the access log; and the error body every refusal carries."""

from __future__ import annotations

import hmac
import logging
import time

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error",
               504: "timeout_error"}


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


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


def document_security(doc: dict, required: bool) -> None:
    """The API-key scheme in the OpenAPI document (bearer or ``X-API-Key``), required on every route that is not
    open (:data:`OPEN_ROUTES`, :data:`OPEN_PATHS`) when the server has a key."""
    doc.setdefault("components", {})["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer", "description": "Authorization: Bearer KEY"},
        "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"}}
    for path, operations in doc.get("paths", {}).items():
        for operation in operations.values():
            operation["security"] = [{"bearer": []}, {"apiKey": []}] if required and not is_open(path) else []


def is_open(path: str) -> bool:
    return path in OPEN_ROUTES or path.startswith(OPEN_PATHS)


class Gate:
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
        if self.key is not None and not is_open(path):
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
