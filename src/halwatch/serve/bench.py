"""``halwatch bench serve``: throughput and latency of the scoring service under concurrent clients, against the
same answers scored in one process (``halwatch score --input``, at several batch sizes) and against a server that
answers one request at a time (the lock pattern: no batching, one forward pass per request).

The answers are real RAGTruth QA answers (official test split, a seeded sample). Each level of concurrency sends
every answer once, ``c`` clients taking the next answer as soon as they have their reply; latency is from sending a
request to its reply. Servers run in this process on a loopback port (uvicorn), so all of them share the same
machine and the same loaded model.
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
    latencies.sort()
    return {"clients": clients, "answers": len(items), "seconds": seconds, "per_s": len(items) / seconds,
            "p50": statistics.median(latencies), "p95": latencies[max(0, int(0.95 * len(latencies)) - 1)],
            "errors": errors}


def _in_process(detector, items: list[dict], batch_size: int) -> float:
    """Answers per second of one process scoring the answers as ``halwatch score --input`` does."""
    from halwatch.eval.speed import throughput
    from halwatch.sample import Sample

    return throughput(detector, [Sample(response=it["response"], prompt=it["prompt"], id=it["id"]) for it in items],
                      batch_size)


def run_serve_bench(detector: str = "default", n: int = 100, levels=(1, 8, 50), batch_sizes=(1, 4, 8),
                    seed: int = 0, out=print, device: str = "auto", dtype: str = "auto",
                    batch_size: int | None = None) -> dict:
    import logging

    from halwatch.detectors import load_detector, read_artifact
    from halwatch.scorer import Scorer
    from halwatch.serve.common import Running
    from halwatch.serve.scoring import Limits, build_app

    logging.getLogger("halwatch").setLevel(logging.ERROR)  # the cut-context warnings are expected here
    items = _answers(n, seed)
    det = load_detector(detector, scorer=Scorer.from_options(identity=read_artifact(detector), cache=None,
                                                             device=device, dtype=dtype))
    model = det._scorer().model
    _in_process(det, items[:4], 1)  # warm up
    result = {"detector": detector, "n": n, "in_process": {}, "batched": [], "one_at_a_time": []}
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
    return result
