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
    logprob: float = float("nan")  # sum of token log-probabilities (nan when the endpoint gives none)
    n_tokens: int = 0  # tokens scored in ``logprob`` (a finished answer's end token included)
    top_first: dict = field(default_factory=dict)  # first token: {token text: log-probability} of the top choices
    token_logprobs: list = field(default_factory=list)  # per token, when asked for
    tokens: list = field(default_factory=list)  # the scored tokens' texts, when asked for ("" for an end token)
    finished: bool = True  # False when cut at max_tokens

    @property
    def mean_logprob(self) -> float:
        return self.logprob / self.n_tokens if self.n_tokens else float("nan")


def yes_probability(completion: Completion) -> float:
    """P(yes) / (P(yes) + P(no)) from the first token's top log-probabilities; from the text when there are none."""
    yes = sum(math.exp(lp) for t, lp in completion.top_first.items() if t.strip().lower().startswith("yes"))
    no = sum(math.exp(lp) for t, lp in completion.top_first.items() if t.strip().lower().startswith("no"))
    if yes + no > 0:
        return yes / (yes + no)
    head = completion.text.strip().lower()
    return 1.0 if head.startswith("yes") else 0.0 if head.startswith("no") else 0.5


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
        import torch

        from halwatch.models.sampling import answer_text, draw_tokens

        if not messages or not any(str(m.get("content", "")).strip() for m in messages):
            raise HalwatchError("empty chat: give at least one message with text")
        tok, model = self.scoring_model.tokenizer, self.scoring_model.model
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        limit = getattr(model.config, "max_position_embeddings", 8192)
        if len(ids) + max_tokens > limit:
            raise HalwatchError(f"the chat has {len(ids)} tokens: with {max_tokens} new tokens it passes the model's "
                                f"{limit} positions")
        with self._lock, torch.inference_mode():
            self.calls += 1
            out = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            cache.batch_repeat_interleave(n)
            drawn = draw_tokens(model, tok, cache, out.logits[:, -1].float().repeat(n, 1), max_tokens, "chat",
                                torch.Generator().manual_seed(seed), max(temperature, 1e-6), 1.0,
                                greedy=temperature <= 0, top_logprobs=top_logprobs)
        result = []
        for b, toks in enumerate(drawn["tokens"]):
            steps = drawn["top"][b] if top_logprobs else []
            top = {tok.decode([t]): lp for t, lp in steps[0][1]} if steps else {}
            scored = len(toks) + int(drawn["done"][b])  # chat mode: a finished answer also scored its end token
            texts = [tok.decode([t]) for t in toks] + [""] * int(drawn["done"][b]) if steps else []
            result.append(Completion(answer_text(tok, toks, "chat"), float(drawn["logprob"][b]), scored, top,
                                     [lp for lp, _ in steps], texts, bool(drawn["done"][b])))
        return result

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
                                         [t["logprob"] for t in tokens], [t.get("token", "") for t in tokens],
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
