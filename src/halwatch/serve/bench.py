"""``halwatch bench serve``: throughput and latency of the scoring service under concurrent clients, against the
same answers scored in one process (``halwatch score --input``, at several batch sizes) and against a server that
answers one request at a time (the lock pattern: no batching, one forward pass per request).

The answers are real RAGTruth QA answers (official test split, a seeded sample). Each level of concurrency sends
every answer once, ``c`` clients taking the next answer as soon as they have their reply; latency is from sending a
request to its reply. Servers run in this process on a loopback port (uvicorn), so all of them share the same
machine and the same loaded model.

Beyond throughput (each part can be chosen with ``parts``):

- ``overload``: requests arrive open-loop (at fixed intervals, whatever the replies) at 2x and 5x the throughput
  measured at one client, for ``overload_seconds``, against a server with a ``timeout`` of 10 s: the share answered
  and refused, the p95 time to a refusal and to an answer, and any other status (504, 5xx);
- ``drain``: 16 requests in flight (a server with a 60 s ``timeout``, which admits them all, and the drain
  timeout ``halwatch serve`` defaults to: the same 60 s), then the stop signal: seconds until the server has
  answered them all and stopped, and how many were answered;
- ``stream``: the guard in front of ``halwatch watch serve-llm``, each stream policy against the upstream alone on
  the same questions: time to the first token and to the last, and the stop policy's checks.
"""

from __future__ import annotations

import asyncio
import statistics
import time


def _answers(n: int, seed: int) -> list[dict]:
    import random

    from halwatch.data.ragtruth import read_ragtruth

    test = read_ragtruth(split="test")
    pick = random.Random(seed).sample(test, n)
    return [{"id": s.id, "prompt": s.prompt, "response": s.response} for s in pick]


async def _level(url: str, items: list[dict], clients: int) -> dict:
    import httpx2 as httpx

    queue = list(range(len(items)))
    latencies, errors = [], 0

    async def client(http):
        nonlocal errors
        while queue:
            i = queue.pop(0)
            t0 = time.perf_counter()
            reply = await http.post(url + "/v1/score", json=items[i])
            latencies.append(time.perf_counter() - t0)
            errors += reply.status_code >= 400

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        seconds = time.perf_counter() - t0
    return {"clients": clients, "answers": len(items), "seconds": seconds, "per_s": len(items) / seconds,
            "p50": statistics.median(latencies), "p95": _p95(latencies), "errors": errors}


def _p95(seconds: list[float]) -> float | None:
    """The 95th percentile (the lower of the two nearest ranks), ``None`` of nothing."""
    ordered = sorted(seconds)
    return ordered[max(0, int(0.95 * len(ordered)) - 1)] if ordered else None


def _in_process(pipeline, items: list[dict], batch_size: int) -> float:
    """Answers per second of one process scoring the answers as ``halwatch score --input`` does, on a thread that
    ends with the measure: torch's parallel work (OpenMP) on a thread that stays alive, this main one, would slow the
    servers' model threads measured next in this process by about 20 % on a CPU."""
    from concurrent.futures import ThreadPoolExecutor

    from halwatch.eval.speed import throughput
    from halwatch.sample import Sample

    samples = [Sample(response=it["response"], prompt=it["prompt"], id=it["id"]) for it in items]
    with ThreadPoolExecutor(max_workers=1) as once:
        return once.submit(throughput, pipeline, samples, batch_size).result()


def run_serve_bench(detector: str = "default", n: int = 100, levels=(1, 8, 50), batch_sizes=(1, 4, 8),
                    seed: int = 0, out=print, device: str = "auto", dtype: str = "auto",
                    batch_size: int | None = None, parts=("throughput", "overload", "drain", "stream"),
                    overload_seconds: float = 30.0) -> dict:
    import logging

    from halwatch.detectors import load_detector
    from halwatch.pipeline import Pipeline
    from halwatch.serve.common import Running
    from halwatch.serve.scoring import Limits, build_app

    logging.getLogger("halwatch").setLevel(logging.ERROR)  # the cut-context warnings are expected here
    items = _answers(n, seed)
    det = Pipeline(load_detector(detector, cache=None, device=device, dtype=dtype))
    model = det.scorer.model
    _in_process(det, items[:4], 1)  # warm up
    result = {"detector": detector, "n": n, "in_process": {}, "batched": [], "one_at_a_time": []}
    if "throughput" not in parts:
        rate = _in_process(det, items[:10], 1)
        out(f"in process, batch 1, 10 answers: {rate:.2f} answers/s (the overload's unit)")
        result.update(run_serve_extras(detector, model, items, rate, out, parts, overload_seconds=overload_seconds))
        return result
    for b in batch_sizes:
        result["in_process"][b] = _in_process(det, items, b)
        out(f"in process, batch {b}: {result['in_process'][b]:.2f} answers/s")
    servers = {"batched": Limits(batch_size=batch_size, queue_tokens=1 << 24, timeout=3600),
               "one_at_a_time": Limits(batch_size=1, batch_wait=0.0, queue_tokens=1 << 24, timeout=3600)}
    for name, limits in servers.items():
        app = build_app([detector], limits=limits, models={model.name: model})
        running = Running(app)
        result[f"{name}_batch_size"] = app.state.service.batch_size
        try:
            for clients in levels:
                row = asyncio.run(_level(running.url, items, clients))
                result[name].append(row)
                out(f"{name} server, {clients} clients: {row['per_s']:.2f} answers/s, p50 {row['p50']:.2f} s, "
                    f"p95 {row['p95']:.2f} s, {row['errors']} errors")
        finally:
            running.stop()
    best = max(result["in_process"].values())
    top = result["batched"][-1]
    result["checks"] = {
        "throughput_vs_in_process": top["per_s"] / best,
        "p95_vs_drain_time": top["p95"] / (top["clients"] / top["per_s"]),
        "vs_one_at_a_time": top["per_s"] / result["one_at_a_time"][-1]["per_s"],
        "errors": sum(r["errors"] for r in result["batched"] + result["one_at_a_time"]),
    }
    out("")
    out("| setting | clients | answers/s | p50 s | p95 s | errors |")
    out("|---|---|---|---|---|---|")
    for b, per_s in result["in_process"].items():
        out(f"| `halwatch score --input`, batch {b} | - | {per_s:.2f} | - | - | - |")
    for name in ("batched", "one_at_a_time"):
        how = "auto: " if batch_size is None else ""
        label = (f"halwatch serve (batch size {how}{result['batched_batch_size']} on {model.device.type})"
                 if name == "batched" else "one request at a time (lock)")
        for r in result[name]:
            out(f"| {label} | {r['clients']} | {r['per_s']:.2f} | {r['p50']:.2f} | {r['p95']:.2f} | {r['errors']} |")
    c = result["checks"]
    out(f"\nat {top['clients']} clients: {c['throughput_vs_in_process']:.2f}x the best in-process throughput "
        f"(target >= 0.9), {c['vs_one_at_a_time']:.2f}x the one-at-a-time server, p95 latency "
        f"{c['p95_vs_drain_time']:.2f}x the time {top['clients']} requests take to drain (target <= 1.5), "
        f"{c['errors']} errors")
    one_client = result["batched"][0]["per_s"]
    result.update(run_serve_extras(detector, model, items, one_client, out, parts, overload_seconds=overload_seconds))
    return result


async def _overload(url: str, items: list[dict], rate: float, seconds: float) -> dict:
    """Open-loop arrivals at ``rate`` requests/s for ``seconds``: what came back, and how fast."""
    import httpx2 as httpx

    answered, refused, other = [], [], []

    async def one(http, item):
        t0 = time.perf_counter()
        reply = await http.post(url + "/v1/score", json=item)
        took = time.perf_counter() - t0
        (answered if reply.status_code == 200 else refused if reply.status_code == 429 else other).append(
            (reply.status_code, took))

    n = max(1, int(rate * seconds))
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=None)) as http:
        tasks = []
        for k in range(n):
            tasks.append(asyncio.create_task(one(http, items[k % len(items)])))
            await asyncio.sleep(1 / rate)
        await asyncio.gather(*tasks)

    return {"sent": n, "rate_per_s": rate, "answered": len(answered), "refused": len(refused),
            "other": sorted({s for s, _ in other}), "n_other": len(other), "answered_share": len(answered) / n,
            "refused_share": len(refused) / n, "p95_refusal_s": _p95([t for _, t in refused]),
            "p95_answer_s": _p95([t for _, t in answered])}


def _drain(app_factory, items: list[dict], in_flight: int = 16, drain_seconds: float = 10.0) -> dict:
    """``in_flight`` requests sent, then the stop signal (what SIGTERM does): seconds to drain and stop (at most
    ``drain_seconds``, ``halwatch serve``'s default: its ``--timeout``)."""
    import signal
    import threading

    import httpx2 as httpx

    from halwatch.serve.common import Running

    running = Running(app_factory(), drain_seconds=drain_seconds)
    replies = [None] * in_flight

    def ask(i):
        try:
            replies[i] = httpx.post(running.url + "/v1/score", json=items[i % len(items)], timeout=3600).status_code
        except httpx.HTTPError as exc:
            replies[i] = type(exc).__name__

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(in_flight)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    t0 = time.perf_counter()
    running.server.handle_exit(signal.SIGTERM, None)
    running.thread.join(3600)
    seconds = time.perf_counter() - t0
    for t in threads:
        t.join()
    return {"in_flight": in_flight, "answered": sum(r == 200 for r in replies), "drain_s": seconds,
            "statuses": sorted({str(r) for r in replies})}


def _stream_timing(url: str, messages: list[dict], policy: str | None, max_tokens: int, every: int) -> dict:
    """One streamed completion through the official openai client: time to the first token and the last."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    extra = {"halwatch_stream_policy": policy, "halwatch_check_every": every} if policy else {}
    t0, first, finish, verdict, text = time.perf_counter(), None, None, None, ""
    for chunk in client.chat.completions.create(model="smollm2-135m", messages=messages, temperature=0,
                                                max_tokens=max_tokens, stream=True, extra_body=extra):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        verdict = (chunk.model_extra or {}).get("halwatch") or verdict
    return {"first_s": first, "last_s": time.perf_counter() - t0, "finish": finish, "chars": len(text),
            "checks": (verdict or {}).get("checks", 0)}


def _streams(model, items: list[dict], detector: str, n: int = 5, max_tokens: int = 64, every: int = 16) -> dict:
    """Each stream policy against the upstream alone, on ``n`` questions: mean times to first and last token."""
    from halwatch.serve.common import Running
    from halwatch.serve.llm import build_app as llm_app
    from halwatch.serve.scoring import build_app

    upstream = Running(llm_app(model))
    guard = Running(build_app([detector], models={model.name: model}, upstream=upstream.url + "/v1"))
    try:
        chats = [[{"role": "system", "content": it["prompt"][:1500]},
                  {"role": "user", "content": "Answer from the passages above in two sentences."}] for it in items[:n]]
        rows = {}
        for policy in (None, "annotate", "hold", "stop"):
            runs = [_stream_timing(upstream.url if policy is None else guard.url, m, policy, max_tokens, every)
                    for m in chats]
            rows[policy or "upstream"] = {
                "first_s": statistics.mean(r["first_s"] for r in runs if r["first_s"] is not None),
                "last_s": statistics.mean(r["last_s"] for r in runs),
                "stopped": sum(r["finish"] == "content_filter" for r in runs),
                "checks": sum(r["checks"] for r in runs) / len(runs)}
        return rows
    finally:
        guard.stop()
        upstream.stop()


def run_serve_extras(detector: str, model, items: list[dict], one_client_rate: float, out=print,
                     parts=("overload", "drain", "stream"), overload=(2, 5), overload_seconds: float = 30.0) -> dict:
    """The overload, drain and stream parts of the bench (module docstring)."""
    from halwatch.serve.common import Running
    from halwatch.serve.scoring import Limits, build_app

    def app(timeout: float = 10.0):
        return build_app([detector], models={model.name: model}, limits=Limits(timeout=timeout))

    result = {}
    if "overload" in parts:
        result["overload"] = []
        for times in overload:
            running = Running(app())
            try:
                row = {"times": times, **asyncio.run(_overload(running.url, items, times * one_client_rate,
                                                               overload_seconds))}
            finally:
                running.stop()
            result["overload"].append(row)
            out(f"{times}x overload ({row['rate_per_s']:.2f}/s for {overload_seconds:g} s, timeout 10 s): "
                f"{row['answered']} answered, {row['refused']} refused (429), other {row['other'] or 'none'}; "
                f"p95 to a refusal {_s(row['p95_refusal_s'])}, to an answer {_s(row['p95_answer_s'])}")
    if "drain" in parts:
        row = result["drain"] = _drain(lambda: app(60.0), items, drain_seconds=60.0)
        out(f"drain: of {row['in_flight']} requests sent, {row['answered']} answered (statuses: "
            f"{', '.join(row['statuses'])}), stopped {row['drain_s']:.2f} s after the signal")
    if "stream" in parts:
        rows = result["stream"] = _streams(model, items, detector)
        base = rows["upstream"]
        out("\n| stream policy | first token s | added | last token s | added | stopped | checks/answer |")
        out("|---|---|---|---|---|---|---|")
        for name, r in rows.items():
            out(f"| {name} | {r['first_s']:.2f} | {r['first_s'] - base['first_s']:+.2f} | {r['last_s']:.2f} | "
                f"{r['last_s'] - base['last_s']:+.2f} | {r['stopped']} | {r['checks']:.1f} |")
    return result


def _s(x) -> str:
    return "-" if x is None else f"{x:.2f} s"
