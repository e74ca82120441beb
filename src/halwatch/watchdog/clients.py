"""LLM clients behind one small interface, for HalMit's agents (target, query generation, evaluation).

``await client.chat(messages, n=1, temperature=0.0, max_tokens=64, seed=0, top_logprobs=0)`` returns ``n``
:class:`Completion` objects. Two kinds:

- :class:`LocalClient`: a local scoring model (``local:smollm2-135m``, ``local:/path/to/hf-model``), run in a worker
  thread; ``n`` samples share one prompt pass (its key/value cache is repeated).
- :class:`OpenAIClient`: any OpenAI-compatible ``/v1/chat/completions`` endpoint (vLLM, llama.cpp server, Ollama,
  hosted APIs, or ``halwatch watch serve-llm``), with a timeout per request, retries with exponential backoff on
  connection errors, timeouts, 429 and 5xx, and at most ``concurrency`` requests in flight.

:func:`open_client` makes either from a URI.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import threading
from dataclasses import dataclass, field

from halwatch.errors import HalwatchError


class EndpointError(HalwatchError):
    """An LLM endpoint cannot be reached or keeps failing."""


@dataclass
class Completion:
    text: str
    logprob: float = float("nan")  # sum of the answer tokens' log-probabilities (nan when the endpoint gives none)
    n_tokens: int = 0  # answer tokens scored in ``logprob``
    top_first: dict = field(default_factory=dict)  # first token: {token text: log-probability} of the top choices
    finished: bool = True  # False when cut at max_tokens

    @property
    def mean_logprob(self) -> float:
        return self.logprob / self.n_tokens if self.n_tokens else float("nan")


def yes_no_word(text: str) -> str:
    """"yes" or "no" when ``text`` is that whole word (any case; surrounding whitespace and trailing punctuation
    such as "." or "," aside), else "": "Yes." is yes, "Not", "None", "Nobody" and "Yesterday" are neither."""
    word = text.strip().rstrip(".,;:!?").strip().lower()
    return word if word in ("yes", "no") else ""


def yes_probability(completion: Completion) -> float:
    """P(yes) / (P(yes) + P(no)) from the first token's top log-probabilities, counting the choices that are the
    word yes or no (as the white-box judge ``halwatch.models.sampling.yes_probability`` does); when none is, from
    the text's first word: 1 for yes, 0 for no, 0.5 for neither."""
    mass = {"yes": 0.0, "no": 0.0, "": 0.0}
    for token, lp in completion.top_first.items():
        mass[yes_no_word(token)] += math.exp(lp)
    if mass["yes"] + mass["no"] > 0:
        return mass["yes"] / (mass["yes"] + mass["no"])
    head = completion.text.split(maxsplit=1)
    return {"yes": 1.0, "no": 0.0}.get(yes_no_word(head[0]) if head else "", 0.5)


class LocalClient:
    """A local causal LM (our model registry or a Hugging Face folder), chat template applied, greedy at
    ``temperature`` 0. Calls run one at a time in a worker thread (one model, one CPU)."""

    def __init__(self, model: str = "smollm2-135m", scoring_model=None):
        from halwatch.models.loader import load_model

        self.scoring_model = scoring_model or load_model(model)
        self.name = f"local:{self.scoring_model.name}"
        self.calls = 0
        self._lock = threading.Lock()

    def complete(self, messages: list[dict], n: int = 1, temperature: float = 0.0, max_tokens: int = 64,
                 seed: int = 0, top_logprobs: int = 0) -> list[Completion]:
        from halwatch.models.chat import complete_chat

        with self._lock:
            self.calls += 1
            result = complete_chat(self.scoring_model, messages, n=n, temperature=temperature,
                                   max_tokens=max_tokens, seed=seed, top_logprobs=top_logprobs)
        return [Completion(c.text.strip(), c.logprob, len(c.logprobs),
                           dict(c.logprobs[0].top) if c.logprobs else {}, c.finish_reason == "stop")
                for c in result.choices]

    async def chat(self, messages, n=1, temperature=0.0, max_tokens=64, seed=0, top_logprobs=0) -> list[Completion]:
        return await asyncio.to_thread(self.complete, messages, n, temperature, max_tokens, seed, top_logprobs)

    async def aclose(self) -> None:
        return None


class OpenAIClient:
    """An OpenAI-compatible chat endpoint. ``base_url`` ends before ``/chat/completions`` (e.g.
    ``http://127.0.0.1:8000/v1``); the API key comes from ``api_key`` or ``$OPENAI_API_KEY``."""

    RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}

    def __init__(self, base_url: str, model: str = "default", api_key: str | None = None, timeout: float = 60.0,
                 retries: int = 3, backoff: float = 0.5, concurrency: int = 4):
        import httpx2 as httpx

        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name = f"{self.base_url}#{model}"
        self.retries, self.backoff = retries, backoff
        self.calls = 0
        key = api_key or os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout), headers=headers,
                                       limits=httpx.Limits(max_connections=concurrency))
        self._gate = asyncio.Semaphore(concurrency)
        self._httpx = httpx

    async def _post(self, payload: dict) -> dict:
        httpx = self._httpx
        url = f"{self.base_url}/chat/completions"
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1) * (1 + 0.1 * random.random()))
            try:
                async with self._gate:
                    self.calls += 1
                    response = await self._http.post(url, json=payload)
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                problem = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code in self.RETRY_STATUS:
                problem = f"HTTP {response.status_code}"
                continue
            if response.status_code >= 400:
                raise EndpointError(f"{url}: HTTP {response.status_code}: {response.text[:200]}")
            try:
                return response.json()
            except ValueError:
                raise EndpointError(f"{url}: the reply is not JSON") from None
        raise EndpointError(f"{url}: no answer after {self.retries + 1} attempts ({problem})")

    async def chat(self, messages, n=1, temperature=0.0, max_tokens=64, seed=0, top_logprobs=0) -> list[Completion]:
        payload = {"model": self.model, "messages": messages, "n": n, "temperature": temperature,
                   "max_tokens": max_tokens, "seed": seed, "logprobs": True}
        if top_logprobs:
            payload["top_logprobs"] = top_logprobs
        data = await self._post(payload)
        try:
            result = []
            for choice in data["choices"]:
                tokens = ((choice.get("logprobs") or {}).get("content")) or []
                top = {t["token"]: t["logprob"] for t in tokens[0].get("top_logprobs", [])} if tokens else {}
                logprob = sum(t["logprob"] for t in tokens) if tokens else float("nan")
                result.append(Completion(choice["message"]["content"] or "", logprob, len(tokens), top,
                                         choice.get("finish_reason") != "length"))
        except (KeyError, TypeError, IndexError):
            raise EndpointError(f"{self.base_url}: not an OpenAI chat completion reply: {str(data)[:200]}") from None
        return result

    async def aclose(self) -> None:
        await self._http.aclose()


def open_client(uri: str, **options):
    """``local:NAME`` (a registry model or a folder) or ``http(s)://HOST[:PORT]/v1[#MODEL]`` (OpenAI-compatible)."""
    if uri.startswith("local:"):
        return LocalClient(uri[len("local:"):] or "smollm2-135m", scoring_model=options.get("scoring_model"))
    if uri.startswith(("http://", "https://")):
        base, _, model = uri.partition("#")
        keep = {k: v for k, v in options.items() if k in ("api_key", "timeout", "retries", "backoff", "concurrency")}
        return OpenAIClient(base, model or "default", **keep)
    raise HalwatchError(f"unknown LLM client {uri!r}: use local:MODEL or http(s)://HOST:PORT/v1[#MODEL]")
