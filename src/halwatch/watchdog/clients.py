"""LLM clients behind one small interface, for HalMit's agents (target, query generation, evaluation).

``await client.chat(messages, n=1, temperature=0.0, max_tokens=64, seed=0, top_logprobs=0)`` returns ``n``
:class:`Completion` objects. Two kinds:

- :class:`LocalClient`: a local scoring model (``local:smollm2-135m``, ``local:/path/to/hf-model``), run in a worker
  thread; ``n`` samples share one prompt pass (its key/value cache is repeated).
- :class:`OpenAIClient`: any OpenAI-compatible ``/v1/chat/completions`` endpoint (vLLM, llama.cpp server, Ollama,
  hosted APIs, or ``halwatch watch serve-llm``), with a timeout per request, retries with exponential backoff on
  connection errors, timeouts, 429 and 5xx, at most ``concurrency`` requests in flight, an API key per endpoint,
  and adaptation to servers that ignore ``n`` or refuse ``logprobs`` / ``max_tokens``.

:func:`open_client` makes either from a URI.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
from dataclasses import dataclass, field

from halwatch.errors import HalwatchError, InputError
from halwatch.models.chat import message_text
from halwatch.net import env_secret, loopback

log = logging.getLogger("halwatch")


class EndpointError(HalwatchError):
    """An LLM endpoint cannot be reached, keeps failing or refuses a request (``status``: its HTTP status)."""

    def __init__(self, message: str, status: int | None = None, body: str = ""):
        super().__init__(message)
        self.status, self.body = status, body


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
    ``http://127.0.0.1:8000/v1``). The API key is ``api_key`` or the environment variable named by ``key_env``, and
    nothing else: a key meant for one endpoint is never sent to another (``$OPENAI_API_KEY`` is not read unless it is
    named). Sending a key over plain HTTP to a host beyond loopback is allowed but logged as a warning.

    Servers differ in what they support; the client finds out from their replies and remembers it:

    - ``n`` ignored (Ollama, llama.cpp's server give one choice): fewer choices than asked -> the rest are asked for
      one at a time (seeds ``seed + 1``, ``seed + 2``, ...), and every later call with ``n > 1`` goes that way;
    - ``logprobs`` refused with a 400 that names it -> asked again without, and never again (log-probabilities are
      then ``nan``, as for a server that ignores the field);
    - ``max_tokens`` refused with a 400 that names it (newer OpenAI models) -> ``max_completion_tokens``;
    - reply content as a list of parts -> their text joined.
    """

    RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}

    def __init__(self, base_url: str, model: str = "default", api_key: str | None = None, key_env: str | None = None,
                 timeout: float = 60.0, retries: int = 3, backoff: float = 0.5, concurrency: int = 4):
        import httpx2 as httpx

        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name = f"{self.base_url}#{model}"
        self.retries, self.backoff = retries, backoff
        self.calls = 0
        self.honours_n, self.logprobs, self.tokens_field = True, True, "max_tokens"
        key = api_key or env_secret(key_env, "the API key variable")
        if key:
            _warn_plain_http(self.base_url)
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
                raise EndpointError(f"{url}: HTTP {response.status_code}: {response.text[:300]}",
                                    status=response.status_code, body=response.text)
            try:
                return response.json()
            except ValueError:
                raise EndpointError(f"{url}: the reply is not JSON") from None
        raise EndpointError(f"{url}: no answer after {self.retries + 1} attempts ({problem})")

    def _payload(self, messages, n, temperature, max_tokens, seed, top_logprobs) -> dict:
        payload = {"model": self.model, "messages": messages, "temperature": temperature,
                   self.tokens_field: max_tokens, "seed": seed}
        if n > 1:
            payload["n"] = n
        if self.logprobs:
            payload["logprobs"] = True
            if top_logprobs:
                payload["top_logprobs"] = top_logprobs
        return payload

    async def _ask(self, messages, n, temperature, max_tokens, seed, top_logprobs) -> list[Completion]:
        """One request, adapting to a server that refuses ``logprobs`` or ``max_tokens`` (each at most once: a
        refusal of what was already dropped is raised)."""
        while True:
            try:
                return self._parse(await self._post(self._payload(messages, n, temperature, max_tokens, seed,
                                                                  top_logprobs)))
            except EndpointError as exc:
                refused = exc.body if exc.status == 400 else ""
                if self.logprobs and "logprobs" in refused:
                    self.logprobs = False
                elif self.tokens_field == "max_tokens" and "max_tokens" in refused:
                    self.tokens_field = "max_completion_tokens"
                else:
                    raise

    def _parse(self, data) -> list[Completion]:
        try:
            result = []
            for choice in data["choices"]:
                tokens = ((choice.get("logprobs") or {}).get("content")) or []
                top = {t["token"]: t["logprob"] for t in tokens[0].get("top_logprobs", [])} if tokens else {}
                logprob = sum(t["logprob"] for t in tokens) if tokens else float("nan")
                content = choice["message"].get("content")
                result.append(Completion("" if content is None else message_text(content), logprob, len(tokens),
                                         top, choice.get("finish_reason") != "length"))
        except (KeyError, TypeError, IndexError, AttributeError, InputError):
            raise EndpointError(f"{self.base_url}: not an OpenAI chat completion reply: {str(data)[:200]}") from None
        return result

    async def chat(self, messages, n=1, temperature=0.0, max_tokens=64, seed=0, top_logprobs=0) -> list[Completion]:
        first = await self._ask(messages, n if self.honours_n else 1, temperature, max_tokens, seed, top_logprobs)
        if len(first) >= n:
            return first[:n]
        if len(first) == 0:
            raise EndpointError(f"{self.base_url}: a reply without choices")
        self.honours_n = False  # one choice for n > 1: ask for the others one by one
        rest = await asyncio.gather(*(self._ask(messages, 1, temperature, max_tokens, seed + i, top_logprobs)
                                      for i in range(len(first), n)))
        return first + [c[0] for c in rest]

    async def aclose(self) -> None:
        await self._http.aclose()


def _warn_plain_http(base_url: str) -> None:
    from urllib.parse import urlsplit

    parts = urlsplit(base_url)
    if parts.scheme == "http" and not loopback(parts.hostname or ""):
        log.warning("sending an API key over plain HTTP to %s: anyone on the way can read it (use https)",
                    parts.hostname)


def open_client(uri: str, keys: dict | None = None, **options):
    """``local:NAME`` (a registry model or a folder) or ``http(s)://HOST[:PORT]/v1[#MODEL]`` (OpenAI-compatible).
    ``keys``: ``{endpoint: environment variable}``, the endpoint written as the URI or its part before ``#``; an
    endpoint not named there gets no key."""
    if uri.startswith("local:"):
        return LocalClient(uri[len("local:"):] or "smollm2-135m", scoring_model=options.get("scoring_model"))
    if uri.startswith(("http://", "https://")):
        base, _, model = uri.partition("#")
        keys = keys or {}
        keep = {k: v for k, v in options.items() if k in ("api_key", "timeout", "retries", "backoff", "concurrency")}
        key_env = keys.get(uri) or keys.get(base) or keys.get(base.rstrip("/"))
        return OpenAIClient(base, model or "default", key_env=key_env, **keep)
    raise HalwatchError(f"unknown LLM client {uri!r}: use local:MODEL or http(s)://HOST:PORT/v1[#MODEL]")
