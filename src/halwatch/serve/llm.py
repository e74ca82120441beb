"""``halwatch watch serve-llm``: a local model behind the OpenAI chat-completions API, as clients use it.

``POST /v1/chat/completions`` takes ``messages`` (content as a string or a list of text parts), ``n``,
``temperature`` (0 = greedy), ``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``stop``, ``seed``,
``logprobs`` / ``top_logprobs``, ``stream`` and ``stream_options.include_usage``. A plain answer carries ``usage``
and each choice's ``finish_reason`` (``stop`` when the model ended it or a stop string came, ``length`` at the token
cap); with ``stream: true`` the text goes out as server-sent events while it is produced (a ``chat.completion.chunk``
per piece, a last chunk per choice with its ``finish_reason``, the usage chunk when asked, then ``data: [DONE]``),
and a client that goes away stops the generation. ``GET /v1/models`` lists the model. Errors are OpenAI error
objects with the status the OpenAI API gives (400 for a malformed or invalid request, 401, 404, 413, 429,
504). The shared pieces (limits, auth, health, metrics, graceful stop) are
:mod:`halwatch.serve.common`'s.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from halwatch.errors import HalwatchError
from halwatch.serve.common import ApiError, ServerState, create_app, errors, watch_disconnect
from halwatch.serve.worker import Worker

#: ``max_tokens`` when a request gives none, and the most a request may ask for.
DEFAULT_MAX_TOKENS = 256
MAX_TOKENS_CAP = 2048

#: ``--mimic``: behave like other servers do, so that clients (the watchdog's) can be tested against each behaviour:
#: ``ignore-n`` answers one choice whatever ``n`` asks (Ollama, llama.cpp's server), ``refuse-logprobs`` answers a
#: request for log-probabilities with 400, ``max-completion-tokens`` refuses ``max_tokens`` with 400 and takes only
#: ``max_completion_tokens`` (newer OpenAI models), ``content-parts`` sends the reply as a list of text parts.
QUIRKS = ("ignore-n", "refuse-logprobs", "max-completion-tokens", "content-parts")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content):
        if isinstance(content, list) and any(p.type != "text" for p in content):
            raise ValueError("only text content parts are supported")
        return content

    def as_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = [{"type": "text", "text": p.text or ""} for p in content]
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatRequest(BaseModel):
    """The chat-completions request; fields the server does not use (``user``, penalties ...) are ignored."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    n: int = Field(1, ge=1, le=16)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_CAP)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_CAP)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop):
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 stop sequences")
        return stop

    def token_cap(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS


def _logprobs(choice, top: int) -> dict:
    return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode()),
                         "top_logprobs": [{"token": a, "logprob": lp, "bytes": list(a.encode())}
                                          for a, lp in t.top[:top]]} for t in choice.logprobs]}


class ChatServer:
    """The routes of one local model. ``scoring_model``: a loaded model, or the name or folder to load at start."""

    def __init__(self, model, queue_tokens: int = 32768, timeout: float = 300.0, device: str = "auto",
                 dtype: str = "auto", quirks=()):
        unknown = set(quirks) - set(QUIRKS)
        if unknown:
            raise HalwatchError(f"unknown --mimic {', '.join(sorted(unknown))}: choose from {', '.join(QUIRKS)}")
        self.quirks = frozenset(quirks)
        self.model_spec, self.scoring_model = model, None if isinstance(model, str) else model
        self.device, self.dtype = device, dtype
        self.worker = Worker(queue_tokens, timeout)  # its deadline is the time limit of a request

    @property
    def name(self) -> str:
        return self.scoring_model.name if self.scoring_model is not None else str(self.model_spec)

    def load(self) -> None:
        if self.scoring_model is None:
            from halwatch.models.loader import load_model

            self.scoring_model = load_model(self.model_spec, device=self.device, dtype=self.dtype)
        # one short generation: the first request does not pay for the first pass, and admission control starts
        # from a measured seconds-per-token
        from halwatch.models.chat import chat_prompt_ids

        warm = ChatRequest(messages=[{"role": "user", "content": "Say hello."}], max_tokens=4, temperature=0)
        ids = chat_prompt_ids(self.scoring_model.tokenizer, [m.as_dict() for m in warm.messages])
        self._generate(warm, cost=len(ids) + warm.token_cap())  # not through _check: a --mimic quirk may refuse it

    def _check(self, request: ChatRequest) -> int:
        """Refuse what can be refused before the model runs: another model's name (404), a chat with no text or
        one that does not fit the model (400). The request's cost for admission: its prompt tokens and the tokens
        it may generate (``n`` x ``max_tokens``)."""
        from halwatch.models.chat import chat_prompt_ids

        if request.model not in (None, "", "default", self.name):
            raise ApiError(404, f"the model {request.model!r} does not exist here: this server has {self.name!r}",
                           "model_not_found", "model")
        if "refuse-logprobs" in self.quirks and (request.logprobs or request.top_logprobs):
            raise ApiError(400, "logprobs is not supported by this server", "unsupported_parameter", "logprobs")
        if "max-completion-tokens" in self.quirks and request.max_tokens is not None:
            raise ApiError(400, "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
                                "'max_completion_tokens' instead.", "unsupported_parameter", "max_tokens")
        if "ignore-n" in self.quirks:
            request.n = 1
        try:
            ids = chat_prompt_ids(self.scoring_model.tokenizer, [m.as_dict() for m in request.messages])
        except HalwatchError as exc:
            raise ApiError(400, str(exc), "invalid_messages", "messages") from None
        limit = getattr(self.scoring_model.model.config, "max_position_embeddings", 8192)
        if len(ids) + request.token_cap() > limit:
            raise ApiError(400, f"the chat has {len(ids)} tokens: with max_tokens {request.token_cap()} it passes "
                                f"the model's {limit} positions", "context_length_exceeded", "messages")
        return len(ids) + request.n * request.token_cap()

    def _generate(self, request: ChatRequest, on_text=None, cancel=None, cost: int = 0):
        from halwatch.models.chat import complete_chat

        t0 = time.perf_counter()
        try:
            return complete_chat(self.scoring_model, [m.as_dict() for m in request.messages], n=request.n,
                                 temperature=request.temperature, top_p=request.top_p,
                                 max_tokens=request.token_cap(), stop=request.stop or (), seed=request.seed,
                                 top_logprobs=request.top_logprobs or 0, on_text=on_text, cancel=cancel)
        finally:
            if cancel is None or not cancel.is_set():
                self.worker.measured(cost, time.perf_counter() - t0)

    def _head(self, completion_id: str, created: int, kind: str) -> dict:
        return {"id": completion_id, "object": kind, "created": created, "model": self.name,
                "system_fingerprint": f"halwatch-{self.name}"}

    async def complete(self, request: ChatRequest, http_request) -> dict:
        cost = self._check(request)
        cancel = threading.Event()
        self.worker.admit(cost)
        job = asyncio.ensure_future(self.worker.run(self._generate, request, None, cancel, cost))
        job.add_done_callback(lambda _: self.worker.release(cost))
        watch = asyncio.ensure_future(watch_disconnect(http_request, cancel.set))
        try:
            result = await asyncio.wait_for(asyncio.shield(job), self.worker.deadline)
        except asyncio.TimeoutError:
            cancel.set()
            raise ApiError(504, f"no answer within {self.worker.deadline:g} s", "timeout") from None
        except HalwatchError as exc:
            raise ApiError(400, str(exc), "invalid_request") from None
        finally:
            watch.cancel()
        choices = []
        for i, c in enumerate(result.choices):
            content = [{"type": "text", "text": c.text}] if "content-parts" in self.quirks else c.text
            choice = {"index": i, "message": {"role": "assistant", "content": content}, "logprobs": None,
                      "finish_reason": c.finish_reason}
            if request.logprobs:
                choice["logprobs"] = _logprobs(c, request.top_logprobs or 0)
            choices.append(choice)
        usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                 "total_tokens": result.prompt_tokens + result.completion_tokens}
        return {**self._head(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), "chat.completion"),
                "choices": choices, "usage": usage}

    async def stream(self, request: ChatRequest):
        """The server-sent events of a streamed completion (an async iterator of ``data:`` lines). The request is
        admitted (or refused with 429) before the first byte goes out."""
        cost = self._check(request)
        self.worker.admit(cost)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def on_text(index: int, delta: str) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ("text", index, delta))

        job = asyncio.ensure_future(self.worker.run(self._generate, request, on_text, cancel, cost))

        def finished(_):
            self.worker.release(cost)
            events.put_nowait(("done", None, None))

        job.add_done_callback(finished)
        return self._events(request, events, job, cancel)

    async def _events(self, request: ChatRequest, events: asyncio.Queue, job, cancel):
        head = self._head(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), "chat.completion.chunk")
        usage_field = {"usage": None} if request.stream_options and request.stream_options.include_usage else {}

        def chunk(choices, **extra) -> str:
            return f"data: {json.dumps({**head, 'choices': choices, **usage_field, **extra})}\n\n"

        try:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(request.n)])
            while True:
                kind, index, delta = await events.get()
                if kind == "done":
                    break
                yield chunk([{"index": index, "delta": {"content": delta}, "logprobs": None, "finish_reason": None}])
            try:
                result = job.result()
            except HalwatchError as exc:
                yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'invalid_request_error'}})}\n\n"
                return
            for i, c in enumerate(result.choices):
                logprobs = _logprobs(c, request.top_logprobs or 0) if request.logprobs else None
                yield chunk([{"index": i, "delta": {}, "logprobs": logprobs, "finish_reason": c.finish_reason}])
            if usage_field:
                yield chunk([], usage={"prompt_tokens": result.prompt_tokens,
                                       "completion_tokens": result.completion_tokens,
                                       "total_tokens": result.prompt_tokens + result.completion_tokens})
            yield "data: [DONE]\n\n"
        finally:
            cancel.set()  # the client went away (or all is sent): stop generating


def build_app(model, api_key: str | None = None, queue_tokens: int = 32768, timeout: float = 300.0,
              max_body_bytes: int = 1 << 20, device: str = "auto", dtype: str = "auto", quirks=()):
    """The serve-llm app: ``model`` is a loaded :class:`~halwatch.models.loader.ScoringModel` or a name/folder
    loaded at start-up on ``device`` in ``dtype`` (the server is ready once it is); ``quirks``: see
    :data:`QUIRKS`."""
    from contextlib import asynccontextmanager

    from prometheus_client import Gauge

    server = ChatServer(model, queue_tokens, timeout, device, dtype, quirks)
    state = ServerState(name="serve-llm")

    @asynccontextmanager
    async def lifespan(app):
        await server.worker.run(server.load)  # on the model thread, as every request later (Worker.run says why)
        state.ready = True
        yield
        state.ready = False
        server.worker.close()

    app = create_app(state, api_key=api_key, max_body_bytes=max_body_bytes, lifespan=lifespan, invalid_status=400,
                     title="halwatch serve-llm", summary="A local model behind the OpenAI chat-completions API")
    Gauge("halwatch_queued_tokens", "Tokens of model work admitted and not yet finished", registry=state.registry
          ).set_function(lambda: server.worker.queued)

    @app.get("/v1/models", responses=errors())
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": int(state.started),
                                            "owned_by": "halwatch"}]}

    @app.post("/v1/chat/completions", responses=errors(404, 413, 429, 504))
    async def chat_completions(body: ChatRequest, request: Request):
        if body.stream:
            return StreamingResponse(await server.stream(body), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await server.complete(body, request)

    app.state.chat = server
    return app
