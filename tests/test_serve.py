"""``halwatch serve``: real uvicorn servers on loopback ports with the real default model and shipped detectors,
driven over HTTP (httpx, the halwatch clients, the official openai client through the guard proxy, and headless
Chromium for the page)."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import pytest

from halwatch.client import AsyncClient, BadRequest, Busy, Client, NotFound, TooLarge, Unauthorized
from halwatch.data.jsonl import write_jsonl
from halwatch.serve.common import Running
from halwatch.serve.scoring import Limits, build_app
from halwatch.serve.worker import Worker

INSULIN = {"context": "Insulin is a peptide hormone produced by beta cells of the pancreatic islets.",
           "question": "Which cells produce insulin?"}
EIFFEL = {"context": "The Eiffel Tower in Paris was completed in 1889 and was designed by the company of Gustave "
                      "Eiffel.",
          "question": "When was the Eiffel Tower completed and who designed it?",
          "response": "The Eiffel Tower was completed in 1925 and was designed by Napoleon Bonaparte."}


def scrape(url: str) -> dict:
    """A server's ``/metrics``, read by prometheus_client's own parser: ``{(sample, sorted label pairs): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def items(short_answers):
    """Real answers (two grounded and two swapped SQuAD-built ones, conftest's) as service items, and the bundled
    demo examples."""
    demo = [json.loads(line) for line in open("src/halwatch/examples/demo.jsonl", encoding="utf-8")]
    real = [{"id": s.id, "prompt": s.prompt, "response": s.response} for s in short_answers[0][2:6]]
    return real + [{k: d[k] for k in ("id", "context", "question", "response") if k in d} for d in demo]


@pytest.fixture(scope="module")
def service(smol):
    running = Running(build_app(["default", "lookback-lens"], models={"smollm2-135m": smol},
                                limits=Limits(batch_size=8, batch_wait=0.05, batch_padding=1.0, max_items=16)))
    yield running
    running.stop()


def test_single_and_batched_scores_equal_the_command(service, items, tmp_path, halwatch):
    """A list scored in one request, the same answers one request each, sent together (the batcher puts them in
    shared forward passes), and `halwatch score` on the same file agree to 1e-4."""
    path = tmp_path / "in.jsonl"
    write_jsonl(path, items)
    out = tmp_path / "out.jsonl"
    halwatch("score", "--input", path, "--output", out, "--no-cache")
    command = [json.loads(line) for line in out.read_text().splitlines()]
    with Client(service.url) as client:
        listed = client.score(items)
        results = [None] * len(items)

        def one(i):
            results[i] = client.score(**items[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(items))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    metrics = scrape(service.url)  # some batches held several answers
    assert metrics["halwatch_batch_size_bucket", (("le", "1.0"),)] < metrics["halwatch_batch_size_count", ()]
    for expected, a, b in zip(command, listed, results):
        for got in (a, b):
            assert got["id"] == expected["id"] and got["hallucinated"] == expected["hallucinated"]
            assert got["score"] == pytest.approx(expected["score"], abs=1e-4)
            assert [(s["start"], s["end"], s["text"]) for s in got["spans"]] == [
                (s["start"], s["end"], s["text"]) for s in expected["spans"]]
            assert got["offset_unit"] == "unicode_code_point" and got["truncated"] == 0
    by_lens = Client(service.url).score(**items[-1], detector="lookback-lens")
    assert by_lens["detector"] == "lookback-lens"
    response = items[-1]["response"]
    assert all(response[s["start"]:s["end"]] == s["text"] for s in by_lens["spans"])
    listing = httpx.get(service.url + "/v1/detectors").json()
    assert listing["default"] == "default"
    assert {d["name"] for d in listing["detectors"]} == {"default", "lookback-lens"}
    assert all("ragtruth" in d["fitted_on"]["data"].lower() for d in listing["detectors"])
    fitted = {d["name"]: d["dtype"] for d in listing["detectors"]}
    assert fitted == {"default": "bfloat16", "lookback-lens": "float32"}  # as each artifact was fitted
    assert all(d["scored_in"] == "float32" for d in listing["detectors"])  # the session's pin


def test_the_model_loads_warms_and_scores_on_one_thread(smol, monkeypatch):
    """torch's parallel work on a second thread that stays alive slows every batch of the model thread by about
    20 % on a CPU (docs/serving.md): the service warms its model up and scores on the worker's one thread (it
    warmed up on an executor thread before)."""
    from halwatch.serve import scoring

    seen = []
    warm_up, compute = scoring.ScoringService.warm_up, scoring.ScoringService.compute

    def noting(step, method):
        def run(self, *args):
            seen.append((step, threading.current_thread().name))
            return method(self, *args)
        return run

    monkeypatch.setattr(scoring.ScoringService, "warm_up", noting("warm up", warm_up))
    monkeypatch.setattr(scoring.ScoringService, "compute", noting("compute", compute))
    running = Running(build_app(["lookback-lens"], models={"smollm2-135m": smol}))
    try:
        got = Client(running.url).score(context="Insulin is made by beta cells.", question="What makes insulin?",
                                        response="Beta cells make insulin.")
    finally:
        running.stop()
    assert 0 <= got["score"] <= 1 and seen[0][0] == "warm up" and len(seen) > 3
    assert {name for _, name in seen} == {seen[0][1]} and seen[0][1].startswith("halwatch-model"), seen


def test_a_long_context_is_scored_in_windows_and_says_so(service, probe):
    long_one = max(probe, key=lambda s: len(s.prompt))
    text = long_one.prompt[long_one.context_span[0]:long_one.context_span[1]]
    got = Client(service.url).score(context=text * 3, question="What is this about?", response=long_one.response)
    # the context does not fit the 1024-token cap beside the answer: every part of it is in some window
    assert got["windows"] > 1 and got["truncated"] == 0


@pytest.mark.parametrize("body,status,words", [
    ({**INSULIN, "response": ""}, 422, "empty response"),
    ({**INSULIN, "response": "   "}, 422, "empty response"),
    (INSULIN, 422, "response"),
    ({**INSULIN, "response": 42}, 422, "valid string"),
    ({"question": "q", "response": "r"}, 422, "give prompt, or context"),
    ({**INSULIN, "contexts": ["a"], "response": "r"}, 422, "not both"),
    ({**INSULIN, "response": "r", "detector": "nope"}, 422, "not loaded"),
    ({**INSULIN, "response": "r", "colour": "blue"}, 422, "colour"),
    ([], 422, "empty list"),
    ("just text", 422, "valid dictionary"),
    ([{**INSULIN, "response": "r"}] * 17, 422, "limit is 16"),
    ({**INSULIN, "response": "word " * 1100}, 422, "over the cap"),
])
def test_bad_input_is_refused_with_a_clear_message(service, body, status, words):
    reply = httpx.post(service.url + "/v1/score", json=body, timeout=60)
    assert reply.status_code == status, reply.text
    assert words in reply.json()["error"]["message"]


def test_the_schema_and_the_server_agree_on_white_space(service):
    """Every character Python counts as white space (U+0085 among them, which JSON Schema's ECMA-262 `\\S` does not
    count) is refused alone by the published schema's pattern, read by an ECMA-262 engine (Node's, where installed)
    and by Python's, and by the server; a character neither counts (U+FEFF) is accepted by both."""
    import re
    import shutil

    schema = httpx.get(service.url + "/openapi.json").json()["components"]["schemas"]["ScoreItem"]
    pattern = schema["properties"]["response"]["pattern"]
    blank = [chr(c) for c in range(0x110000) if chr(c).isspace()]
    assert "\u0085" in blank and len(blank) > 20
    assert not any(re.search(pattern, c) for c in blank) and re.search(pattern, "\ufeff")
    node = shutil.which("node")
    if node:  # an ECMA-262 engine reads the pattern alike
        script = ("const r = new RegExp(process.argv[1], 'u'); const xs = JSON.parse(process.argv[2]); "
                  "console.log(JSON.stringify(xs.map(x => r.test(x))))")
        out = subprocess.run([node, "-e", script, pattern, json.dumps(blank + ["\ufeff"])], capture_output=True,
                             text=True, check=True).stdout
        assert json.loads(out) == [False] * len(blank) + [True]
    for c in ("\u0085", "\u3000", " \t"):
        reply = httpx.post(service.url + "/v1/score", json={**INSULIN, "response": c}, timeout=60)
        assert reply.status_code == 422 and "empty response" in reply.json()["error"]["message"]


def test_malformed_bodies_and_the_server_stays_healthy(service):
    url = service.url + "/v1/score"
    headers = {"content-type": "application/json"}
    assert httpx.post(url, content=b"{oops", headers=headers).status_code == 400
    assert httpx.post(url, content=b'{"response": "\xff\xfe"}', headers=headers).status_code == 400
    big = httpx.post(url, content=b" " * (5 << 20), headers=headers)
    assert big.status_code == 413 and "limit" in big.json()["error"]["message"]
    assert httpx.get(service.url + "/health/ready").status_code == 200
    assert Client(service.url).score(**INSULIN, response="Beta cells.")["score"] > 0


def test_clients_raise_typed_errors(service):
    with Client(service.url) as client:
        with pytest.raises(BadRequest, match="empty response"):
            client.score(**INSULIN, response=" ")
        with pytest.raises(BadRequest, match="limit is 16"):
            client.score([{**INSULIN, "response": "r"}] * 20)

    async def go():
        async with AsyncClient(service.url) as client:
            assert await client.ready()
            return await client.score(**INSULIN, response="Beta cells make it."), await client.detectors()

    result, listing = asyncio.run(go())
    assert 0 < result["score"] < 1 and listing["default"] == "default"


def test_api_key_on_and_off(smol):
    running = Running(build_app(["default"], api_key="k-123", models={"smollm2-135m": smol}))
    try:
        with pytest.raises(Unauthorized):
            Client(running.url, api_key="wrong").score(**INSULIN, response="Beta cells.")
        assert Client(running.url, api_key="k-123").score(**INSULIN, response="Beta cells.")["score"] > 0
        assert httpx.post(running.url + "/v1/score", json={**INSULIN, "response": "Beta cells."},
                          headers={"X-API-Key": "k-123"}).status_code == 200
        assert httpx.get(running.url + "/health/ready").status_code == 200  # probes need no key
        assert httpx.get(running.url + "/v1/detectors").status_code == 401
    finally:
        running.stop()


def test_overload_is_refused_at_once_never_left_to_time_out(smol):
    """More clients than the worker can serve within the time limit: every request is a 200 or a 429 (with an
    honest Retry-After), every refusal at the door comes within half the time limit (a request left to time out
    would take all of it), none waits into a 504 or a 5xx; a request larger than the whole queue is 413."""
    running = Running(build_app(["default"], models={"smollm2-135m": smol},
                                limits=Limits(queue_tokens=20_000, timeout=3.0, batch_size=1, batch_wait=0.0)))
    try:
        body = {**INSULIN, "response": "Insulin is produced by the beta cells of the pancreatic islets. " * 8}

        async def one(http):
            t0 = time.perf_counter()
            reply = await http.post(running.url + "/v1/score", json=body)
            return reply, time.perf_counter() - t0

        async def flood():
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(*(one(http) for _ in range(40)))

        replies = asyncio.run(flood())
        statuses = [r.status_code for r, _ in replies]
        # no 504: every admitted request was answered within the limit, as the server measures it (the client's own
        # times here include this process's 40 connections, which share its two cores with the server)
        assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}, statuses
        refused = [(r, t) for r, t in replies if r.status_code == 429]
        at_once = [t for r, t in refused if "admitted" not in r.json()["error"]["message"]]
        # (under 1 s on the 2-core machines of earlier runs, 0.91-1.09 s on one about twice as slow, the client's 40
        # connections included: "at once" is measured against the 3 s limit they would otherwise have waited)
        assert at_once and max(at_once) < 1.5
        assert all(t < 3.0 for r, t in refused)  # shed after admission (next test): still before the limit
        busy = refused[0][0]
        assert int(busy.headers["retry-after"]) >= 1 and "busy" in busy.json()["error"]["message"]
        with pytest.raises(Busy) as err:
            from halwatch.client import _raise_for

            _raise_for(busy)
        assert err.value.retry_after >= 1
        with pytest.raises(TooLarge, match="even on an idle server"):  # no retry could ever help it
            Client(running.url).score([{**INSULIN, "response": "Beta cells. " * 200}] * 64)
        metrics = httpx.get(running.url + "/metrics").text
        assert "halwatch_queue_wait_seconds_count" in metrics and 'verdict="supported"' in metrics
        assert httpx.get(running.url + "/health/ready").status_code == 200
    finally:
        running.stop()


def test_work_admitted_on_a_low_estimate_is_shed_before_it_times_out(smol):
    """Admission trusts the seconds per token measured so far. Where the model then runs slower (here the estimate
    is set 5x too low, as a warm-up on an idle machine would be for a busy one), the answers admitted on it are
    refused as soon as a finished batch shows they would be late: 429 with Retry-After, never a 504. The worker's
    arithmetic, by hand: at 0.01 s per unit, 100 units ahead, an answer admitted 1 s ago of 100 units is done 3 s
    after its admission, past 80 % of a 3 s limit; the one before it, 2 s after.

    The limit is set from the time one answer takes on this machine, now (a fixed 3 s is more than one answer's
    time on an idle machine and less on a busy one, where even the first admitted answer overran it): 8 answers'
    time. At a fifth of the true rate all 12 are admitted; once the first batch is measured, those that would be
    done past 80 % of the limit (about the 7th on) are shed."""
    worker = Worker(1000, 3.0)
    worker.measured(100, 1.0)
    assert worker.overdue([(100, 9.0), (100, 9.0)], 10.0) == {1: pytest.approx(3.0)}
    assert worker.overdue([(50, 10.0)], 10.0) == {}
    app = build_app(["default"], models={"smollm2-135m": smol},
                    limits=Limits(queue_tokens=20_000, timeout=600.0, batch_size=1, batch_wait=0.0))
    running = Running(app)
    try:
        worker = app.state.service.worker
        body = {**INSULIN, "response": "Insulin is produced by the beta cells of the pancreatic islets. " * 8}
        started = time.perf_counter()
        assert httpx.post(running.url + "/v1/score", json=body, timeout=600).status_code == 200
        worker.deadline = 8 * (time.perf_counter() - started)  # the limit the service holds answers to
        rate = worker.rate
        worker.recent.clear()
        worker.measured(1, rate / 5)

        async def flood():
            async with httpx.AsyncClient(timeout=600) as http:
                return await asyncio.gather(*(http.post(running.url + "/v1/score", json=body) for _ in range(12)))

        replies = asyncio.run(flood())
        statuses = [r.status_code for r in replies]
        assert 200 in statuses and set(statuses) <= {200, 429}, (statuses, worker.deadline)
        shed = [r for r in replies if r.status_code == 429 and "admitted" in r.json()["error"]["message"]]
        assert shed and all(int(r.headers["retry-after"]) >= 1 for r in shed)
        assert httpx.get(running.url + "/health/ready").status_code == 200
    finally:
        running.stop()


def test_fifty_clients_four_requests_each(service):
    """A load test: 50 concurrent clients x 4 requests (short ones: the server is under test here, not the model),
    every one answered, no 5xx, the server alive after."""
    async def client(k):
        async with httpx.AsyncClient(timeout=300) as http:
            return [await http.post(service.url + "/v1/score", json={
                "id": f"{k}-{j}", "prompt": f"Which city is the capital of country number {k}?",
                "response": ["Paris.", "It is Rome.", "Berlin, I think."][(k + j) % 3]}) for j in range(4)]

    async def everyone():
        return await asyncio.gather(*(client(k) for k in range(50)))

    replies = [r for per_client in asyncio.run(everyone()) for r in per_client]
    assert len(replies) == 200 and {r.status_code for r in replies} == {200}
    assert httpx.get(service.url + "/health/ready").status_code == 200


#: The served process's time limit and its clients' (seconds) in the SIGTERM test.
WAIT = 600


def test_a_served_process_big_inputs_access_log_and_sigterm_drain(tmp_path):
    """`halwatch serve` as a process: a 3.9 MB context is tokenized off the event loop (the readiness probe answers
    within 100 ms throughout) and scored in two windows, its left part cut; a chunked 5 MB body is 413; each request
    leaves one JSON access-log line without the texts; SIGTERM with 16 requests in flight answers every one of
    them."""
    log_path = tmp_path / "access.jsonl"
    # A time limit of 600 s, not serve's 120: beside another test worker on 2 cores, batches ran so slowly that
    # the server (rightly) shed one of the 16 as past 0.8 x 120 s; admission is tested on its own above.
    proc = subprocess.Popen([sys.executable, "-m", "halwatch", "serve", "--port", "0", "--access-log", str(log_path),
                             "--windows", "2", "--timeout", str(WAIT)],
                            stderr=subprocess.PIPE, text=True, env={**os.environ})
    try:
        lines = []
        while not lines or "halwatch serve at" not in lines[-1]:
            lines.append(proc.stderr.readline())
            assert lines[-1], "".join(lines)
        base = lines[-1].split(" at ", 1)[1].split()[0]

        context = ("The Eiffel Tower in Paris was completed in 1889 and was designed by the company of Gustave "
                   "Eiffel. " * 40_000)[:3_900_000]
        result, probes = {}, []

        def big():
            result["reply"] = httpx.post(base + "/v1/score", timeout=WAIT, json={
                "context": context, "question": "When was it completed?", "response": "It was completed in 1889."})

        asker = threading.Thread(target=big)
        asker.start()
        with httpx.Client(timeout=10) as http:
            while asker.is_alive():
                t0 = time.perf_counter()
                assert http.get(base + "/health/ready").status_code == 200
                probes.append(time.perf_counter() - t0)
                time.sleep(0.01)
        asker.join()
        reply = result["reply"].json()
        assert result["reply"].status_code == 200 and reply["truncated"] > 500_000 and reply["windows"] == 2
        assert len(probes) >= 3 and max(probes) < 0.1, probes

        def chunks():
            for _ in range(5):
                yield b" " * (1 << 20)

        chunked = httpx.post(base + "/v1/score", content=chunks(), headers={"content-type": "application/json"})
        assert chunked.status_code == 413 and "limit" in chunked.json()["error"]["message"]

        items = [{**INSULIN, "id": str(i), "response": "Insulin comes from the beta cells. " * (4 + i)}
                 for i in range(16)]
        replies = [None] * 16

        def ask(i):
            replies[i] = httpx.post(base + "/v1/score", json=items[i], timeout=WAIT)

        def received():
            """/v1/score requests the server holds or has answered with 200 since the big one (its own metrics)."""
            value = scrape(base)
            return (value.get(("halwatch_requests_in_flight", (("route", "/v1/score"),)), 0)
                    + value.get(("halwatch_requests_total", (("route", "/v1/score"), ("status", "200"))), 0) - 1)

        askers = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
        for t in askers:
            t.start()
        deadline = time.monotonic() + 60
        while received() < 16 and time.monotonic() < deadline:  # SIGTERM once all 16 are in: none is refused
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        for t in askers:
            t.join(WAIT)
        assert [r.status_code for r in replies] == [200] * 16
        assert [r.json()["id"] for r in replies] == [str(i) for i in range(16)]
        assert proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        proc.kill()
        proc.wait()
    logged = [json.loads(line) for line in log_path.read_text().splitlines()]
    scored = [e for e in logged if e["route"] == "/v1/score" and e["status"] == 200]
    assert len(scored) == 17 and all(e["items"] == 1 and e["tokens"] > 0 and e["compute_s"] > 0 for e in scored)
    assert all(e["queue_wait_s"] >= 0 and e["method"] == "POST" for e in scored)
    assert "Eiffel" not in log_path.read_text() and "beta cells" not in log_path.read_text()
    assert any(e["status"] == 413 for e in logged)


@pytest.fixture(scope="module")
def guarded(smol):
    from halwatch.serve.llm import build_app as llm_app

    upstream = Running(llm_app(smol))
    guard = Running(build_app(["default"], models={"smollm2-135m": smol}, upstream=upstream.url + "/v1"))
    yield guard
    guard.stop()
    upstream.stop()


def test_guard_proxy_adds_a_verdict_plain_and_streamed(guarded):
    import openai

    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": INSULIN["context"]}, {"role": "user", "content": INSULIN["question"]}]
    plain = client.chat.completions.create(model="smollm2-135m", messages=messages, temperature=0, max_tokens=24)
    answer = plain.choices[0].message.content
    verdict = plain.model_extra["halwatch"]
    assert answer and verdict["context_from"] == "system" and verdict["detector"] == "routed"
    assert verdict["task"] == "qa"  # a chat's system message and question: the QA part
    direct = Client(guarded.url).score(**INSULIN, response=answer)
    assert verdict["score"] == pytest.approx(direct["score"], abs=1e-4)
    assert verdict["hallucinated"] == direct["hallucinated"] and verdict["spans"] == direct["spans"]

    # the context as a field of the request, which the upstream never sees
    named = httpx.post(guarded.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": INSULIN["question"]}], "halwatch_context": INSULIN["context"],
        "temperature": 0, "max_tokens": 24}).json()
    assert named["halwatch"]["context_from"] == "halwatch_context" and 0 < named["halwatch"]["score"] < 1
    cited = httpx.post(guarded.url + "/v1/chat/completions", timeout=120, json={
        "messages": messages, "temperature": 0, "max_tokens": 24, "halwatch_evidence": "attention"}).json()
    assert cited["choices"][0]["message"]["content"] == answer
    sentences = cited["halwatch"]["evidence"]
    assert sentences and re.sub(r"\W", "", "".join(s["text"] for s in sentences)) == re.sub(r"\W", "", answer)
    assert all(x["field"] == "context" and x["text"] in INSULIN["context"] for s in sentences for x in s["sources"])
    bad_mode = httpx.post(guarded.url + "/v1/chat/completions", json={"messages": messages,
                                                                      "halwatch_evidence": "relevance"})
    assert bad_mode.status_code == 400 and "halwatch_evidence" in bad_mode.text

    with httpx.stream("POST", guarded.url + "/v1/chat/completions", timeout=120, json={
            "messages": messages, "temperature": 0, "max_tokens": 24, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in events if c.get("choices"))
    assert text == answer  # the upstream's chunks came through
    assert lines[-1] == "data: [DONE]" and events[-1]["choices"] == [] and "halwatch" in events[-1]
    assert events[-1]["halwatch"]["score"] == pytest.approx(verdict["score"], abs=1e-4)

    bad = httpx.post(guarded.url + "/v1/chat/completions", json={"messages": []})
    assert bad.status_code == 400
    upstream_refusal = httpx.post(guarded.url + "/v1/chat/completions",
                                  json={"messages": messages, "model": "another-model"})
    assert upstream_refusal.status_code == 404 and "does not exist" in upstream_refusal.text


def test_stream_policies_through_the_official_client(guarded):
    """annotate, hold and stop, read by the official openai client from `halwatch serve --upstream` in front of
    `halwatch watch serve-llm`: annotate passes the answer through and ends with the verdict; hold releases the
    same answer and verdict only once it is scored; stop cuts an answer the detector flags while it streams, ending
    with finish_reason content_filter and the verdict on the text it judged."""
    import openai

    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": INSULIN["context"]},
                {"role": "user", "content": "Who discovered insulin, and in which year and city?"}]
    seen = {}
    for policy in ("annotate", "hold", "stop"):
        t0, first, text, finish, verdict = time.perf_counter(), None, "", None, None
        stream = client.chat.completions.create(model="smollm2-135m", messages=messages, temperature=0,
                                                max_tokens=48, stream=True,
                                                extra_body={"halwatch_stream_policy": policy,
                                                            "halwatch_check_every": 6})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - t0
                text += chunk.choices[0].delta.content
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            verdict = (chunk.model_extra or {}).get("halwatch") or verdict
        seen[policy] = {"text": text, "finish": finish, "verdict": verdict, "first": first,
                        "total": time.perf_counter() - t0}
    annotate, hold, stop = seen["annotate"], seen["hold"], seen["stop"]
    assert annotate["text"] == hold["text"] and annotate["finish"] == hold["finish"] != "content_filter"
    assert annotate["verdict"]["score"] == pytest.approx(hold["verdict"]["score"], abs=1e-4)
    assert annotate["verdict"]["hallucinated"], "the example must be one the detector flags"
    assert hold["first"] > 0.9 * hold["total"]  # nothing before the verdict
    assert annotate["first"] < 0.5 * annotate["total"]
    assert stop["finish"] == "content_filter" and stop["verdict"]["stopped"] and stop["verdict"]["hallucinated"]
    assert annotate["text"].startswith(stop["text"]) and len(stop["text"]) < len(annotate["text"])
    judged = stop["verdict"]["judged_text"]
    assert stop["text"].startswith(judged) and all(judged[s["start"]:s["end"]] == s["text"]
                                                   for s in stop["verdict"]["spans"])
    bad = httpx.post(guarded.url + "/v1/chat/completions", json={
        "messages": messages, "stream": True, "halwatch_stream_policy": "block"})
    assert bad.status_code == 400 and "annotate, hold, stop" in bad.json()["error"]["message"]


def _check_on_page(page, url: str, item: dict, detector: str, reload: bool = True):
    """Type ``item`` into the page at ``url`` (opened anew unless ``reload`` is false), check it with ``detector``
    and return the highlighted marks."""
    if reload:
        page.goto(url + "/")
    page.wait_for_selector(f"#detector option[value='{detector}']", state="attached")
    for field, key in (("#context", "context"), ("#question", "question"), ("#answer", "response")):
        page.fill(field, item[key])
    page.select_option("#detector", detector)
    page.click("#check")
    page.wait_for_selector(".result")
    return page.locator(".result mark")


def test_the_page_in_headless_chromium(service, chromium, tmp_path):
    """The web page as a user sees it: type an example, submit, and the answer comes back with the unsupported
    words highlighted as the API flags them."""
    answer = "Insulin is produced by the beta cells of the pancreas. It was discovered in 1921 by Banting in Paris."
    expected = Client(service.url).score(**INSULIN, response=answer, detector="lookback-lens")
    assert expected["spans"], "the example should have a flagged span"
    page = chromium.new_page()
    try:
        marks = _check_on_page(page, service.url, {**INSULIN, "response": answer}, "lookback-lens")
        assert [marks.nth(i).inner_text() for i in range(marks.count())] == [s["text"] for s in expected["spans"]]
        assert marks.first.get_attribute("title").startswith("confidence ")
        verdict = page.inner_text(".result .verdict")
        assert verdict == ("Hallucinated" if expected["hallucinated"] else "Supported")
        assert f"{expected['score']:.4f}" in page.inner_text(".result .score")
        page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
    finally:
        page.close()
    assert (tmp_path / "page.png").stat().st_size > 10_000


def test_the_default_highlights_the_made_up_words_on_the_page(service, chromium):
    """Issue 33's example on the page with the default detector: the highlight is the made-up year and name and
    nothing the context supports; each mark shows its confidence on hover; a request that asks for confident spans
    only gets those."""
    page = chromium.new_page()
    try:
        marks = _check_on_page(page, service.url, EIFFEL, "default")
        marked = [marks.nth(i).inner_text() for i in range(marks.count())]
        titles = [marks.nth(i).get_attribute("title") for i in range(marks.count())]
    finally:
        page.close()
    assert any("1925" in m for m in marked) and any("Napoleon Bonaparte" in m for m in marked), marked
    supported = {w.lower() for w in EIFFEL["context"].replace(".", "").split()}
    assert not [w for m in marked for w in m.split() if w.lower() in supported], marked
    assert all(t.startswith("confidence ") for t in titles)
    confidences = sorted(float(t.split()[1]) for t in titles)
    strict = Client(service.url).score(**EIFFEL, min_span_confidence=(confidences[0] + confidences[-1]) / 2)
    assert 0 < len(strict["spans"]) < len(marked) or confidences[0] == confidences[-1]
    assert all(span["confidence"] >= (confidences[0] + confidences[-1]) / 2 for span in strict["spans"])
    refused = httpx.post(service.url + "/v1/score", json={**EIFFEL, "min_span_confidence": 1.5})
    assert refused.status_code == 422 and "min_span_confidence" in refused.text


def test_evidence_over_http_typed_and_on_the_page(service, chromium, smol):
    """Evidence asked for over HTTP is typed in the OpenAPI document and equals the library's; on the page,
    hovering an answer sentence lights its sources in the context, and a flagged sentence says it has none."""
    import halwatch as hw

    item = {"context": "The Eiffel Tower was completed in 1889 for the World's Fair. It stands on the Champ de Mars "
                       "in Paris. Gustave Eiffel's company designed and built it. The tower is 330 metres tall.",
            "question": "Who built the Eiffel Tower, and how tall is it?",
            "response": "Gustave Eiffel's company built it. The tower is 500 metres tall and was designed by Le "
                        "Corbusier."}
    got = httpx.post(service.url + "/v1/score", json={**item, "evidence": "attention"}, timeout=120).json()
    local = hw.load(model=smol).check(**item, evidence="attention")
    assert [(s["start"], s["end"], s["supported"], [x["text"] for x in s["sources"]]) for s in got["evidence"]] == [
        (s.start, s.end, s.supported, [x.text for x in s.sources]) for s in local.evidence]
    schema = httpx.get(service.url + "/openapi.json").json()["components"]["schemas"]
    assert {"SentenceEvidence", "Source"} <= set(schema) and "evidence" in schema["ScoreItem"]["properties"]
    for mode in ("nope", "relevance"):  # relevance (seconds per answer) is the library's, not the service's
        refused = httpx.post(service.url + "/v1/score", json={**item, "evidence": mode})
        assert refused.status_code == 422 and "evidence" in refused.text
    page = chromium.new_page()
    try:
        page.goto(service.url + "/")
        page.check("#evidence")
        _check_on_page(page, service.url, item, "default", reload=False)
        sentences = page.locator(".result .sentence")
        assert sentences.count() == len(got["evidence"]) == 2
        for i, expected in enumerate(got["evidence"]):
            sentences.nth(i).hover()
            lit = page.locator(".result .source.lit")
            assert [lit.nth(k).inner_text() for k in range(lit.count())] == [
                x["text"] for x in sorted(expected["sources"], key=lambda x: x["start"])]
            note = page.inner_text(".result .evidence-note")
            assert note.startswith("No evidence") != expected["supported"]
        assert not got["evidence"][1]["supported"] and got["evidence"][0]["sources"]
        page.uncheck("#evidence")  # off: the answer alone, as before
        page.click("#check")
        page.wait_for_selector(".result .answer")
        assert page.locator(".result .sentence").count() == 0 and page.locator(".result .context").count() == 0
    finally:
        page.close()


def test_with_a_key_the_page_and_docs_open_the_api_closed_and_the_contract_fuzzed(smol, chromium, tmp_path):
    """With --api-key-env: the page, its files, /docs and the OpenAPI document load without a key (a browser cannot
    send one), the API answers 401 with WWW-Authenticate; the page asks for the key and sends it; the OpenAPI
    document states the security scheme; 405 names the allowed methods; and Schemathesis (every check, a fixed
    seed) finds no response that breaks the document."""
    running = Running(build_app(["default"], api_key="k-123", models={"smollm2-135m": smol},
                                limits=Limits(max_items=3)))
    try:
        for path in ("/", "/static/app.js", "/docs", "/openapi.json"):
            assert httpx.get(running.url + path).status_code == 200, path
        doc = httpx.get(running.url + "/openapi.json").json()
        assert set(doc["components"]["securitySchemes"]) == {"bearer", "apiKey"}
        score_doc = doc["paths"]["/v1/score"]["post"]
        assert score_doc["security"] and {"401", "413", "422", "429", "503"} <= set(score_doc["responses"])
        closed = httpx.get(running.url + "/v1/detectors")
        assert closed.status_code == 401 and closed.headers["www-authenticate"].startswith("Bearer")
        trace = httpx.request("TRACE", running.url + "/v1/score", headers={"X-API-Key": "k-123"})
        assert trace.status_code == 405 and trace.headers["allow"] == "POST"

        answer = "Insulin is produced by red blood cells in the bone marrow."
        expected = Client(running.url, api_key="k-123").score(**INSULIN, response=answer)
        page = chromium.new_page()
        try:
            page.goto(running.url + "/")
            page.wait_for_selector("#status.error")
            assert "API key" in page.inner_text("#status")
            page.fill("#key", "k-123")
            page.dispatch_event("#key", "change")
            page.wait_for_selector("#detector option[value='default']", state="attached")
            page.fill("#context", INSULIN["context"])
            page.fill("#question", INSULIN["question"])
            page.fill("#answer", answer)
            page.click("#check")
            page.wait_for_selector(".result")
            assert f"{expected['score']:.4f}" in page.inner_text(".result .score")
        finally:
            page.close()

        st = os.path.join(os.path.dirname(sys.executable), "st")
        fuzz = subprocess.run([st, "run", running.url + "/openapi.json", "--checks", "all", "--max-examples", "30",
                               "--seed", "1", "-H", "Authorization: Bearer k-123", "--no-color"],
                              capture_output=True, text=True, timeout=600, cwd=tmp_path)  # its cache: not here
        assert fuzz.returncode == 0 and "No issues found" in fuzz.stdout, fuzz.stdout[-3000:]
    finally:
        running.stop()


def test_watch_check_against_a_store(smol, service, tmp_path):
    """POST /v1/watch/check: HalMit's monitor on a store with three boundary points around a question (Algorithm 1,
    case 1: near a cluster of them), and a clear 404 where no store is configured."""
    from halwatch.watchdog.embed import embed
    from halwatch.watchdog.store import open_store

    store = open_store(f"sqlite:{tmp_path / 'warsaw.db'}")
    questions = ["How far is Warsaw from Berlin?", "What is the distance from Warsaw to Berlin?",
                 "How many kilometres separate Warsaw and Berlin?"]
    for q, v in zip(questions, embed(questions)):
        store.add_point(q, v, entropy=1.0, answers=["a", "b"], method="gqa")
    store.set_meta(domain="Warsaw", k=2, sample_temperature=0.5)
    store.close()
    running = Running(build_app(["default"], models={"smollm2-135m": smol},
                                watch={"store": f"sqlite:{tmp_path / 'warsaw.db'}", "target": "local:smollm2-135m"}))
    try:
        verdict = Client(running.url).watch_check("How far is it from Warsaw to Berlin?")
        assert verdict["case"] == "centroid" and verdict["hallucination"] is True
        assert {n["query"] for n in verdict["neighbours"]} == set(questions)
        empty = httpx.post(running.url + "/v1/watch/check", json={"query": ""})
        assert empty.status_code == 422
    finally:
        running.stop()
    with pytest.raises(NotFound, match="no HalMit store"):
        Client(service.url).watch_check("How far is Warsaw from Berlin?")


def test_batches_hold_the_oldest_answer_and_answers_of_similar_length():
    from halwatch.serve.scoring import pick_batch

    lengths = [100, 500, 98, 510, 102, 97]
    assert pick_batch(lengths, 3, 8192, 0.1) == [0, 2, 4]  # nearest in length to the oldest, no 500s
    assert pick_batch(lengths, 8, 8192, 0.1) == [0, 2, 4, 5]
    assert pick_batch(lengths, 8, 300, 0.1) == [0, 2, 5]  # 3 x 102 > 300 padded tokens: 102 skipped, 97 fits
    assert pick_batch(lengths[1:], 8, 8192, 0.1) == [0, 2]  # 500 with 510 (2% padding), not with the 100s
    assert pick_batch(lengths, 8, 8192, 1.0) == [0, 1, 2, 3, 4, 5]
    assert pick_batch([7], 8, 8192, 0.1) == [0]
