"""``halwatch watch serve-llm``: a real uvicorn server on a loopback port with the real default model, driven by the
official ``openai`` client as users drive it, plus raw HTTP for what a client library never sends."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import openai
import pytest

from halwatch.serve.common import Running
from halwatch.serve.llm import build_app

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def server(smol):
    running = Running(build_app(smol))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_plain_and_streamed_completions_with_the_official_client(client, server):
    plain = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0, max_tokens=24,
                                           seed=1)
    choice = plain.choices[0]
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason == "stop" and plain.model == "smollm2-135m" and plain.object == "chat.completion"
    usage = plain.usage
    assert usage.prompt_tokens > 10 and 0 < usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    chunks = list(client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0,
                                                 max_tokens=24, seed=1, stream=True,
                                                 stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 3  # the text arrives in pieces, not at once
    assert "".join(pieces) == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == usage.total_tokens

    cut = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0,
                                         max_completion_tokens=3)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3

    # the raw event stream ends with data: [DONE]
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json={"messages": QUESTION, "temperature": 0, "max_tokens": 8, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def test_n_stop_seed_logprobs_and_content_parts(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Count from one to ten: "},
                                          {"type": "text", "text": "one, two,"}]}]
    three = client.chat.completions.create(model="smollm2-135m", messages=parts, n=3, temperature=1.0, seed=7,
                                           max_tokens=16)
    again = client.chat.completions.create(model="smollm2-135m", messages=parts, n=3, temperature=1.0, seed=7,
                                           max_tokens=16)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.message.content for c in three.choices] == [c.message.content for c in again.choices]
    assert len({c.message.content for c in three.choices}) > 1  # sampled, not three copies

    full = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0, max_tokens=24)
    assert "Paris" in full.choices[0].message.content
    stopped = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0,
                                             max_tokens=24, stop=["Paris"])
    text = stopped.choices[0].message.content
    assert "Paris" not in text and full.choices[0].message.content.startswith(text)
    assert stopped.choices[0].finish_reason == "stop"

    scored = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0, max_tokens=6,
                                            logprobs=True, top_logprobs=3)
    content = scored.choices[0].logprobs.content
    assert len(content) == scored.usage.completion_tokens or scored.choices[0].finish_reason == "stop"
    assert "".join(t.token for t in content) == scored.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob, abs=1e-5)  # greedy: the best one
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2-135m"]


def _raw(server, request: bytes) -> str:
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        return sock.recv(65536).decode("latin-1")


@pytest.mark.parametrize("bad", [
    {"messages": []},
    {"messages": QUESTION, "n": 0},
    {"messages": QUESTION, "temperature": 7},
    {"messages": QUESTION, "max_tokens": 100000},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "user", "content": "   "}]},
    {"messages": QUESTION, "stop": ["a", "b", "c", "d", "e"]},
])
def test_bad_requests_get_the_clients_typed_error(client, bad):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2-135m", **bad)
    assert err.value.status_code == 400 and err.value.body["message"]


def test_malformed_http_and_the_server_stays_healthy(client, server):
    url = server.url + "/v1/chat/completions"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=QUESTION)
    assert httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
    assert httpx.post(url, content=b"\xff\xfe\x00", headers={"content-type": "application/json"}).status_code == 400
    big = httpx.post(url, content=b"x" * (2 << 20), headers={"content-type": "application/json"})
    assert big.status_code == 413 and "limit" in big.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    # what no client library sends: a negative or non-numeric Content-Length
    for length in (b"-5", b"abc"):
        reply = _raw(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + length
                     + b"\r\n\r\n{}")
        assert reply.startswith("HTTP/1.1 400")
    assert httpx.get(server.url + "/health/ready").json() == {"status": "ready"}
    ok = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0, max_tokens=4)
    assert ok.choices[0].message.content
    metrics = httpx.get(server.url + "/metrics").text
    assert 'halwatch_requests_total{route="/v1/chat/completions",status="413"}' in metrics
    assert 'halwatch_errors_total{route="other",status="404"}' in metrics


def test_api_key_is_required_when_configured(smol):
    running = Running(build_app(smol, api_key="s3cret-key"))
    try:
        url = running.url + "/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).chat.completions.create(
                model="smollm2-135m", messages=QUESTION, max_tokens=2)
        good = openai.OpenAI(base_url=url, api_key="s3cret-key", max_retries=0)
        assert good.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=2).choices
        assert httpx.get(url + "/models", headers={"X-API-Key": "s3cret-key"}).status_code == 200
        assert httpx.get(url + "/models").status_code == 401
        assert httpx.get(running.url + "/health/live").status_code == 200  # probes need no key
    finally:
        running.stop()


def test_admission_by_tokens_and_a_disconnect_stops_generating(smol):
    """Admission control by tokens of model work: a request that does not fit beside the work queued is refused at
    once (429, Retry-After), one larger than the whole queue is 413, and so is one whose estimated model time alone
    passes the time limit (at once, rather than 504 after waiting); a streaming client that goes away stops the
    generation."""
    app = build_app(smol, queue_tokens=2000, timeout=600)
    running = Running(app)
    long = {"messages": [{"role": "user", "content": "Write the numbers from 1 to 1000, one per line."}],
            "temperature": 0, "max_tokens": 1500, "stream": True}
    try:
        with httpx.stream("POST", running.url + "/v1/chat/completions", json=long, timeout=60) as stream:
            lines = stream.iter_lines()
            got = [next(lines) for _ in range(6)]  # generation is under way
            assert all(line.startswith("data: ") or not line for line in got)
            t0 = time.perf_counter()
            busy = httpx.post(running.url + "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 600})
            assert time.perf_counter() - t0 < 1.0
            assert busy.status_code == 429 and int(busy.headers["retry-after"]) >= 1
            assert busy.json()["error"]["type"] == "rate_limit_error"
        # the client went away: the model thread stops well before 1500 tokens and takes the next request
        deadline = time.time() + 10
        while app.state.chat.worker.queued and time.time() < deadline:
            time.sleep(0.05)
        assert app.state.chat.worker.queued == 0
        huge = httpx.post(running.url + "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1999})
        assert huge.status_code == 413 and "whole queue" in huge.json()["error"]["message"]
        assert httpx.post(running.url + "/v1/chat/completions",
                          json={"messages": QUESTION, "max_tokens": 2}).status_code == 200
    finally:
        running.stop()
    running = Running(build_app(smol, timeout=1.0))
    try:
        t0 = time.perf_counter()
        slow = httpx.post(running.url + "/v1/chat/completions", timeout=60,
                          json={"messages": long["messages"], "temperature": 0, "max_tokens": 1500})
        assert time.perf_counter() - t0 < 1.0
        assert slow.status_code == 413 and "past the 1 s limit" in slow.json()["error"]["message"]
    finally:
        running.stop()


def test_sigterm_drains_a_request_in_flight(tmp_path):
    """The command as a user runs it: SIGTERM while a completion is being generated lets it finish (200), then
    the server stops listening and the process ends (by the signal it was sent, as uvicorn does)."""
    proc = subprocess.Popen([sys.executable, "-m", "halwatch", "watch", "serve-llm", "--port", "0"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ})
    try:
        lines = []
        while not lines or "serving smollm2-135m at" not in lines[-1]:
            lines.append(proc.stderr.readline())
            assert lines[-1], "".join(lines)  # the process ended before it served
        base = lines[-1].split(" at ", 1)[1].split("/v1", 1)[0]
        assert base.startswith("http://127.0.0.1:")
        assert httpx.get(base + "/health/ready").json() == {"status": "ready"}
        result = {}

        def ask():
            result["reply"] = httpx.post(base + "/v1/chat/completions", timeout=120,
                                         json={"messages": QUESTION, "temperature": 0, "max_tokens": 40,
                                               "stop": ["\n\n\n"]})

        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        asker.join(120)
        assert result["reply"].status_code == 200 and result["reply"].json()["choices"][0]["message"]["content"]
        assert proc.wait(60) in (0, -signal.SIGTERM)
        with pytest.raises(httpx.TransportError):
            httpx.get(base + "/health/live", timeout=2)
    finally:
        proc.kill()
        proc.wait()


def test_listening_beyond_loopback_needs_a_key_or_insecure():
    proc = subprocess.run([sys.executable, "-m", "halwatch", "watch", "serve-llm", "--host", "0.0.0.0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "without an API key" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "halwatch", "watch", "serve-llm", "--api-key-env", "NO_SUCH_VAR_X"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "NO_SUCH_VAR_X": ""})
    assert proc.returncode == 2 and "NO_SUCH_VAR_X" in proc.stderr
