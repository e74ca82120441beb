"""The guard proxy of ``halwatch serve --upstream URL``: ``POST /v1/chat/completions`` is forwarded to any
OpenAI-compatible server (vLLM, llama.cpp, Ollama, ``halwatch watch serve-llm``), and the assistant's answer comes
back with a ``halwatch`` verdict added.

Where the context comes from (the convention, in this order):

1. ``halwatch_context``: a string or a list of strings in the request body (removed before forwarding);
2. otherwise the system (or developer) messages;
3. otherwise there is no separate context, and the whole conversation before the answer is the prompt.

The question is the last user message. A plain reply gets ``halwatch``: the verdict of the first choice (``score``,
``hallucinated``, ``threshold``, ``spans`` ...) and, with ``n`` > 1, ``choices`` with one verdict per choice. With
``stream: true`` the upstream chunks pass through as they come, and the verdict follows as one more event,
``data: {"object": "halwatch.verdict", "halwatch": {...}}``, before ``data: [DONE]``. Upstream errors pass through
with their status; an upstream that cannot be reached is 502, one that does not answer in time 504.
"""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from halwatch.models.chat import message_text
from halwatch.serve.common import ApiError


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

    def __init__(self, upstream: str, api_key: str | None, service, timeout: float = 300.0):
        import httpx2 as httpx

        self.url = upstream.rstrip("/") + "/chat/completions"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), headers=headers)
        self.httpx = httpx
        self.service = service

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
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise ApiError(400, "the request body is not valid JSON (UTF-8)", "invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", "invalid_json")
        item, source = context_of(body)
        forwarded = {k: v for k, v in body.items() if k != "halwatch_context"}
        if forwarded.get("stream"):
            return await self._stream(forwarded, item, source)
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

    async def _stream(self, forwarded: dict, item: dict, source: str):
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

        async def events():
            answers: dict[int, str] = {}
            try:
                async for line in reply.aiter_lines():
                    if line.strip() == "data: [DONE]":
                        break
                    if line.startswith("data: "):
                        try:
                            chunk = json.loads(line[6:])
                        except ValueError:
                            chunk = {}
                        for choice in chunk.get("choices") or []:
                            delta = (choice.get("delta") or {}).get("content") or ""
                            answers[choice.get("index", 0)] = answers.get(choice.get("index", 0), "") + delta
                    yield line + "\n"
            finally:
                await upstream.__aexit__(None, None, None)
            texts = [answers.get(i, "") for i in range(max(answers, default=-1) + 1)]
            try:
                verdict = await self.verdicts(item, texts, source)
            except ApiError as exc:
                verdict = {"error": exc.message}
            yield f"data: {json.dumps({'object': 'halwatch.verdict', 'halwatch': verdict})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
