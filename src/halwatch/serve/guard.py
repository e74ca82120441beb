"""The guard proxy of ``halwatch serve --upstream URL``: ``POST /v1/chat/completions`` is forwarded to any
OpenAI-compatible server (vLLM, llama.cpp, Ollama, ``halwatch watch serve-llm``), and the assistant's answer comes
back with a ``halwatch`` verdict added.

Where the context comes from (the convention, in this order):

1. ``halwatch_context``: a string or a list of strings in the request body (removed before forwarding);
2. otherwise the system (or developer) messages;
3. otherwise there is no separate context, and the whole conversation before the answer is the prompt.

The question is the last user message. A plain reply gets ``halwatch``: the verdict of the first choice (``score``,
``hallucinated``, ``threshold``, ``spans`` ...) and, with ``n`` > 1, ``choices`` with one verdict per choice.
``"halwatch_evidence": "attention"`` in the request body adds each answer sentence's sources in
the context (``evidence``, :mod:`halwatch.evidence`).

With ``stream: true`` the stream policy (``--stream-policy``, or ``halwatch_stream_policy`` in the request) decides:

- ``annotate``: the upstream's chunks pass through as they come; the verdict follows as one more chunk (no
  choices, a ``halwatch`` field) before ``data: [DONE]``.
- ``hold``: the chunks are held until the answer is complete and scored, then released with the verdict chunk.
- ``stop``: the chunks pass through as they come while the growing answer is scored every ``check_every`` chunks
  (``--stream-check-every``, or ``halwatch_check_every``; one check at a time, in the background). When the answer so
  far is judged hallucinated, the stream ends at once with a chunk whose ``finish_reason`` is ``"content_filter"``
  (as OpenAI ends filtered content) carrying the verdict and its spans; the upstream is closed. The upstream's own
  last chunk waits for the check of the whole answer, so that a complete answer judged hallucinated ends the same
  way. At most the chunks that arrive during one check pass beyond the text that was judged.

Upstream errors pass through with their status; an upstream that cannot be reached is 502, one that does not answer
in time 504.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from halwatch.models.chat import message_text
from halwatch.serve.common import STREAM_POLICIES, ApiError, read_json


def context_of(body: dict) -> tuple[dict, str]:
    """The score item of a chat request (without its ``response``), and where the context came from."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ApiError(400, "messages: a non-empty list of message objects is required", "invalid_messages",
                       "messages")
    texts = [(m.get("role"), message_text(m.get("content") or "")) for m in messages]
    users = [t for role, t in texts if role == "user"]
    question = users[-1] if users else ""
    given = body.get("halwatch_context")
    if given is not None:
        if isinstance(given, str):
            given = [given]
        if not isinstance(given, list) or not all(isinstance(x, str) for x in given) or not "".join(given).strip():
            raise ApiError(400, "halwatch_context must be a non-empty string or list of strings", "invalid_context",
                           "halwatch_context")
        return {"contexts": given, "question": question}, "halwatch_context"
    system = [t for role, t in texts if role in ("system", "developer") and t.strip()]
    if system and question:
        return {"contexts": system, "question": question}, "system"
    prompt = "\n".join(f"{role}: {t}" for role, t in texts)
    return {"prompt": prompt}, "conversation"


class Guard:
    """Forwards chat completions to ``upstream`` (``http://HOST:PORT/v1``) and scores the answers through the
    service's batching queue."""

    def __init__(self, upstream: str, api_key: str | None, service, timeout: float = 300.0,
                 stream_policy: str = "annotate", check_every: int = 16):
        import httpx2 as httpx

        self.url = upstream.rstrip("/") + "/chat/completions"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), headers=headers)
        self.httpx = httpx
        self.service = service
        self.stream_policy, self.check_every = _policy(stream_policy, check_every)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def verdicts(self, item: dict, answers: list[str], source: str) -> dict:
        scored = [i for i, a in enumerate(answers) if a.strip()]
        results = await self.service.score_body([{**item, "response": answers[i]} for i in scored]) if scored else []
        by_index = dict(zip(scored, results))
        choices = [{"index": i, **by_index[i]} if i in by_index else {"index": i, "skipped": "empty answer"}
                   for i in range(len(answers))]
        first = {k: v for k, v in choices[0].items() if k not in ("index", "id")} if choices else {}
        verdict = {**first, "context_from": source}
        if len(choices) > 1:
            verdict["choices"] = [{k: v for k, v in c.items() if k != "id"} for c in choices]
        return verdict

    def _failure(self, exc) -> ApiError:
        if isinstance(exc, self.httpx.TimeoutException):
            return ApiError(504, f"the upstream LLM did not answer in time ({self.url})", "upstream_timeout")
        return ApiError(502, f"the upstream LLM cannot be reached ({self.url}): {type(exc).__name__}",
                        "upstream_unreachable")

    async def handle(self, request: Request):
        body = await read_json(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", "invalid_json")
        item, source = context_of(body)
        evidence = body.get("halwatch_evidence")
        if evidence is not None:
            if evidence != "attention":
                raise ApiError(400, f"halwatch_evidence must be 'attention' (or absent), got {evidence!r}",
                               "invalid_evidence", "halwatch_evidence")
            item["evidence"] = evidence
        policy, every = _policy(body.get("halwatch_stream_policy", self.stream_policy),
                                body.get("halwatch_check_every", self.check_every))
        forwarded = {k: v for k, v in body.items() if not k.startswith("halwatch_")}
        if forwarded.get("stream"):
            return await self._stream(forwarded, item, source, policy, every)
        try:
            reply = await self.http.post(self.url, json=forwarded)
        except self.httpx.HTTPError as exc:
            raise self._failure(exc) from None
        if reply.status_code >= 400:
            return Response(reply.content, status_code=reply.status_code,
                            media_type=reply.headers.get("content-type", "application/json"))
        data = reply.json()
        answers = [message_text((c.get("message") or {}).get("content") or "") for c in data.get("choices", [])]
        data["halwatch"] = await self.verdicts(item, answers, source)
        return JSONResponse(data)

    async def _stream(self, forwarded: dict, item: dict, source: str, policy: str, every: int):
        upstream = self.http.stream("POST", self.url, json=forwarded)
        try:
            reply = await upstream.__aenter__()
        except self.httpx.HTTPError as exc:
            raise self._failure(exc) from None
        if reply.status_code >= 400:
            content = await reply.aread()
            await upstream.__aexit__(None, None, None)
            return Response(content, status_code=reply.status_code,
                            media_type=reply.headers.get("content-type", "application/json"))
        run = _StreamRun(self, item, source, every)
        events = {"annotate": run.annotate, "hold": run.hold, "stop": run.stop}[policy](reply, upstream)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _policy(policy, every) -> tuple[str, int]:
    """A checked stream policy and check interval, or a 400 naming the field."""
    if policy not in STREAM_POLICIES:
        raise ApiError(400, f"halwatch_stream_policy must be one of {', '.join(STREAM_POLICIES)}, got {policy!r}",
                       "invalid_stream_policy", "halwatch_stream_policy")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ApiError(400, f"halwatch_check_every must be a positive integer, got {every!r}",
                       "invalid_check_every", "halwatch_check_every")
    return policy, every


class _StreamRun:
    """One streamed completion through the guard: the upstream's ``data:`` lines, the answers they build, and the
    verdict chunks of the three policies."""

    def __init__(self, guard: Guard, item: dict, source: str, every: int):
        self.guard, self.item, self.source, self.every = guard, item, source, every
        self.answers: dict[int, str] = {}
        self.head = {"object": "chat.completion.chunk"}  # id, created, model: from the upstream's chunks

    def texts(self) -> list[str]:
        return [self.answers.get(i, "") for i in range(max(self.answers, default=-1) + 1)]

    def read(self, line: str) -> dict | None:
        """The chunk of one ``data:`` line (``None`` for other lines), folded into the answers so far."""
        if not line.startswith("data: "):  # [DONE] never comes here: :meth:`lines` ends before it
            return None
        try:
            chunk = json.loads(line[6:])
        except ValueError:
            return None
        if not isinstance(chunk, dict):
            return None
        self.head.update({k: chunk[k] for k in ("id", "created", "model") if k in chunk})
        for choice in chunk.get("choices") or []:
            delta = (choice.get("delta") or {}).get("content") or ""
            self.answers[choice.get("index", 0)] = self.answers.get(choice.get("index", 0), "") + delta
        return chunk

    async def verdict(self, texts: list[str] | None = None) -> dict:
        """The verdict on ``texts`` (default: the answers so far), with the first one as ``judged_text``."""
        texts = self.texts() if texts is None else texts
        try:
            verdict = await self.guard.verdicts(self.item, texts, self.source)
        except ApiError as exc:
            verdict = {"error": exc.message}
        return {**verdict, "judged_text": texts[0] if texts else ""}

    def event(self, choices: list, verdict: dict) -> str:
        return f"data: {json.dumps({**self.head, 'choices': choices, 'halwatch': verdict})}\n\n"

    async def lines(self, reply, upstream):
        """The upstream's events up to ``[DONE]``, one line each with its blank line (OpenAI's chunks are one
        ``data:`` line per event); the upstream is closed however the loop ends."""
        try:
            async for line in reply.aiter_lines():
                if line.strip() == "data: [DONE]":
                    return
                if line.strip():
                    yield line + "\n\n"
        finally:
            await upstream.__aexit__(None, None, None)

    async def annotate(self, reply, upstream):
        async for line in self.lines(reply, upstream):
            self.read(line)
            yield line
        yield self.event([], await self.verdict())
        yield "data: [DONE]\n\n"

    async def hold(self, reply, upstream):
        held = []
        async for line in self.lines(reply, upstream):
            self.read(line)
            held.append(line)
        verdict = await self.verdict()
        for line in held:
            yield line
        yield self.event([], verdict)
        yield "data: [DONE]\n\n"

    async def stop(self, reply, upstream):
        checking: asyncio.Task | None = None
        since, checks = 0, 0
        last: list[str] = []  # the upstream's closing lines (finish_reason, usage), held for the final check
        lines = self.lines(reply, upstream)
        try:
            async for line in lines:
                chunk = self.read(line)
                if chunk is not None and any(c.get("finish_reason") for c in chunk.get("choices") or []) or last:
                    last.append(line)
                    continue
                yield line
                if chunk is not None and chunk.get("choices"):
                    since += 1
                if checking is not None and checking.done():
                    verdict, checking = checking.result(), None
                    if _flagged(verdict):
                        yield self.stopped(verdict, checks)
                        return
                if checking is None and since >= self.every and any(t.strip() for t in self.texts()):
                    since, checks = 0, checks + 1
                    checking = asyncio.ensure_future(self.verdict(self.texts()))
            if checking is not None:
                checking.cancel()
            verdict = await self.verdict()
            checks += 1
            if _flagged(verdict):
                yield self.stopped(verdict, checks)
                return
            for line in last:
                yield line
            yield self.event([], {**verdict, "checks": checks})
            yield "data: [DONE]\n\n"
        finally:
            await lines.aclose()
            if checking is not None and not checking.done():
                checking.cancel()

    def stopped(self, verdict: dict, checks: int) -> str:
        """The last chunk of a stream ended for a hallucinated answer, then ``[DONE]``."""
        choices = [{"index": i, "delta": {}, "logprobs": None, "finish_reason": "content_filter"}
                   for i in range(max(1, len(self.answers)))]
        return self.event(choices, {**verdict, "stopped": True, "checks": checks}) + "data: [DONE]\n\n"


def _flagged(verdict: dict) -> bool:
    return bool(verdict.get("hallucinated")) or any(c.get("hallucinated") for c in verdict.get("choices", []))
