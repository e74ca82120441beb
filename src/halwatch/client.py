"""Python clients of ``halwatch serve``: :class:`Client` (blocking) and :class:`AsyncClient`, on httpx, with one
typed exception per kind of refusal.

    from halwatch.client import Client
    with Client("http://127.0.0.1:8080") as hw:
        result = hw.score(context="...", question="...", response="...")
        print(result["score"], result["hallucinated"], result["spans"])
"""

from __future__ import annotations

import os

from halwatch.errors import HalwatchError


class ServiceError(HalwatchError):
    """The service refused or failed a request: ``status``, ``code`` and the service's ``message``."""

    def __init__(self, status: int, message: str, code: str | None = None, retry_after: float | None = None):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message, self.code, self.retry_after = status, message, code, retry_after


class BadRequest(ServiceError):
    """400 or 422: the request or one of its items is malformed or invalid."""


class Unauthorized(ServiceError):
    """401: a missing or wrong API key."""


class NotFound(ServiceError):
    """404: no such route, or nothing configured for it (no store, no upstream)."""


class TooLarge(ServiceError):
    """413: the body or the number of items is over the service's limit."""


class Busy(ServiceError):
    """429: the queue is full; ``retry_after`` says when to try again."""


class Timeout(ServiceError):
    """504: not answered within the service's time limit."""


class ServerError(ServiceError):
    """5xx: the service failed."""


_BY_STATUS = {400: BadRequest, 422: BadRequest, 401: Unauthorized, 404: NotFound, 413: TooLarge, 429: Busy,
              504: Timeout}


def _raise_for(response) -> None:
    if response.status_code < 400:
        return
    try:
        error = response.json()["error"]
        message, code = error.get("message", ""), error.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, code = response.text[:200], None
    retry = response.headers.get("retry-after")
    kind = _BY_STATUS.get(response.status_code, ServerError if response.status_code >= 500 else ServiceError)
    raise kind(response.status_code, message, code, float(retry) if retry else None)


def _body(items, fields: dict):
    """The JSON body of a score call: one item's fields, or a list of items."""
    if items is None:
        return fields
    if fields:
        raise ValueError("give items, or the fields of one item, not both")
    return list(items)


def _headers(api_key: str | None) -> dict:
    key = api_key if api_key is not None else os.environ.get("HALWATCH_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


class Client:
    """Blocking client. ``api_key`` defaults to ``$HALWATCH_API_KEY``."""

    def __init__(self, base_url: str = "http://127.0.0.1:8080", api_key: str | None = None, timeout: float = 300.0):
        import httpx2 as httpx

        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=_headers(api_key), timeout=timeout)

    def _call(self, method: str, path: str, **kwargs):
        response = self._http.request(method, path, **kwargs)
        _raise_for(response)
        return response.json()

    def score(self, items: list[dict] | None = None, **fields):
        """Score one answer (``context``, ``question``, ``response`` ... as keywords: a result dict) or a list of
        item dicts (a list of result dicts)."""
        return self._call("POST", "/v1/score", json=_body(items, fields))

    def detectors(self) -> dict:
        return self._call("GET", "/v1/detectors")

    def watch_check(self, query: str) -> dict:
        return self._call("POST", "/v1/watch/check", json={"query": query})

    def ready(self) -> bool:
        return self._http.get("/health/ready").status_code == 200

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient:
    """The same calls for asyncio code."""

    def __init__(self, base_url: str = "http://127.0.0.1:8080", api_key: str | None = None, timeout: float = 300.0):
        import httpx2 as httpx

        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=_headers(api_key), timeout=timeout)

    async def _call(self, method: str, path: str, **kwargs):
        response = await self._http.request(method, path, **kwargs)
        _raise_for(response)
        return response.json()

    async def score(self, items: list[dict] | None = None, **fields):
        return await self._call("POST", "/v1/score", json=_body(items, fields))

    async def detectors(self) -> dict:
        return await self._call("GET", "/v1/detectors")

    async def watch_check(self, query: str) -> dict:
        return await self._call("POST", "/v1/watch/check", json={"query": query})

    async def ready(self) -> bool:
        return (await self._http.get("/health/ready")).status_code == 200

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()
