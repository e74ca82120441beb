"""``halwatch bench speed``: load time, forward time with and without attention capture, and peak memory.

Inputs are real RAGTruth QA texts: the passages of several sources form the context, so that the token cap cuts the
prompt to (about) the asked length; the response is a real RAGTruth answer.
"""

from __future__ import annotations

import queue
import resource
import statistics
import subprocess
import sys
import time

from halwatch.data.ragtruth import seeded_sample
from halwatch.errors import first_line
from halwatch.timing import sync


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def median_seconds(fn, repeats: int, warm_up: bool = True) -> float:
    if warm_up:
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _load_seconds(model: str, device: str, dtype: str) -> tuple[float, float, float]:
    """In a fresh process: import of torch + transformers, the first load of the model from the cache (which also
    imports transformers' model and tokenizer modules lazily), and a second load (files only), on ``device`` in
    ``dtype`` (the measuring process's)."""
    load = f"load_model({model!r}, pull_missing=False, device={device!r}, dtype={dtype!r})"
    code = (
        "import time; t0 = time.perf_counter(); import torch, transformers; t1 = time.perf_counter();"
        f"from halwatch.models import load_model; {load}; t2 = time.perf_counter();"
        f"{load}; t3 = time.perf_counter();"
        "print(t1 - t0, t2 - t1, t3 - t2)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return float(out[-3]), float(out[-2]), float(out[-1])


def toha_heads(model_name: str) -> list:
    """The heads of the shipped default artifact when it is a TOHA fitted for this model, else ten heads of the
    layers where TOHA's heads were found on RAGTruth (DESIGN.md: layers 18-23)."""
    from halwatch.detectors import read_artifact

    art = read_artifact("default")
    if art["detector"] == "toha" and art.get("scoring_model") == model_name:
        return [tuple(h) for h in art["state"]["heads"]]
    return [(21, 6), (19, 0), (18, 3), (20, 1), (22, 4), (23, 2), (21, 0), (19, 5), (20, 7), (22, 8)]


def ripser_comparison(rows, n_prompt: int, out=print) -> dict:
    """Our MTop-Div against ripser's H0 barcode on the same attention rows (ripser: a test dependency)."""
    import numpy as np

    from halwatch.signals.topology import mtopdiv

    try:
        from ripser import ripser
    except ImportError:
        out("ripser is not installed (pip install ripser): MTop-Div cross-check skipped")
        return {}
    t0 = time.perf_counter()
    ours = mtopdiv(rows, n_prompt).total
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs = []
    n = rows.shape[2]
    for head in rows:
        w = np.zeros((n, n))
        w[n_prompt:, :] = head
        d = 1.0 - np.maximum(w, w.T)
        d[:n_prompt, :n_prompt] = 0.0
        np.fill_diagonal(d, 0.0)
        bars = ripser(d, distance_matrix=True, maxdim=0)["dgms"][0]
        theirs.append(float(np.sum(bars[np.isfinite(bars[:, 1]), 1] - bars[np.isfinite(bars[:, 1]), 0])))
    t_ripser = time.perf_counter() - t0
    diff = float(np.max(np.abs(ours - np.array(theirs))))
    out(f"MTop-Div of {len(rows)} heads ({rows.shape[1]} response x {n} tokens): ours {t_ours * 1e3:.1f} ms, "
        f"ripser {t_ripser * 1e3:.0f} ms ({t_ripser / t_ours:.0f}x), max difference {diff:.1e}")
    return {"ours_s": t_ours, "ripser_s": t_ripser, "max_diff": diff}


def default_pipeline(scoring_model):
    """The shipped default detector's scoring path on this scoring model (no disk cache)."""
    from halwatch.detectors import load_detector
    from halwatch.pipeline import Pipeline
    from halwatch.scorer import Scorer

    return Pipeline(load_detector("default", scorer=Scorer(model=scoring_model, cache=None)))


def speed_samples(lengths):
    """One sample per length, cut to that many tokens by the scorer's cap."""
    from halwatch.data.ragtruth import read_ragtruth
    from halwatch.sample import Sample

    rt = read_ragtruth(split="test", generator="llama-2-7b-chat")
    passages = "\n\n".join(s.prompt[s.context_span[0] : s.context_span[1]] for s in rt[:12])
    base = min(rt, key=lambda s: abs(len(s.response) - 300))  # a response of about 70 tokens
    prompt = base.prompt[: base.context_span[0]] + passages + base.prompt[base.context_span[1] :]
    start = base.context_span[0]
    return {n: Sample(id=f"speed-{n}", prompt=prompt, response=base.response,
                      context_span=(start, start + len(passages))) for n in lengths}


def throughput(pipeline, samples, batch_size: int | None) -> float:
    """Answers per second of the whole scoring path (:class:`halwatch.pipeline.Pipeline`, as ``halwatch score``
    runs it: encoding, signals in batches of ``batch_size`` answers, or of the scorer's token budget with ``None``,
    scores and spans)."""
    sync()
    t0 = time.perf_counter()
    pipeline.score(pipeline.encode(samples), batch_size=batch_size)
    sync()
    return len(samples) / (time.perf_counter() - t0)


def plain_forward(scoring_model, views, batches) -> None:
    """The model's own forward over ``batches`` (lists of indices into ``views``), each padded, one logit per
    answer and no capture: the floor that the whole path is compared with."""
    import torch

    from halwatch.models.forward import padded

    sm = scoring_model
    with torch.inference_mode():
        for batch in batches:
            ids, mask = padded([views[i] for i in batch], sm.tokenizer.pad_token_id or 0)
            sm.model(input_ids=ids.to(sm.device), attention_mask=mask.to(sm.device), logits_to_keep=1,
                     use_cache=False)


def answers_per_second(pipeline, n: int = 32, seed: int = 0) -> dict:
    """:func:`throughput` on ``n`` real RAGTruth test answers (a seeded sample), one at a time and in batches of
    similar length (the scorer's token budget), each after a warm-up on two of them."""
    samples = seeded_sample(n, seed)
    out = {}
    for label, size in (("one_at_a_time", 1), ("batched", None)):
        throughput(pipeline, samples[:2], size)  # warm-up
        out[label] = throughput(pipeline, samples, size)
    return out


def _by_length(scorer, samples) -> tuple[list, list]:
    """``(samples, their views)`` sorted by length in tokens, as ``halwatch score`` batches them (little padding)."""
    views = [scorer.encode(s) for s in samples]
    order = sorted(range(len(views)), key=lambda i: len(views[i].input_ids))
    return [samples[i] for i in order], [views[i] for i in order]


class ForwardClock:
    """Seconds spent inside ``model``'s forward (everything between its forward pre-hook and its forward hook,
    the attention capture included), summed over calls, with the device synchronised at both ends."""

    def __init__(self, model):
        self.seconds, self._t0 = 0.0, None
        self.handles = [model.register_forward_pre_hook(self._start), model.register_forward_hook(self._stop)]

    def _start(self, *args):
        sync()
        self._t0 = time.perf_counter()

    def _stop(self, *args):
        sync()
        self.seconds += time.perf_counter() - self._t0

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def forward_split(pipeline, n: int = 32, batches=(1, 8, 32), seed: int = 0, out=print, samples=None) -> list[dict]:
    """Per answer, for batches of ``batches`` answers of ``n`` real RAGTruth test answers (a seeded sample, sorted
    by length so that a batch pads little, as ``halwatch score`` batches): the whole scoring path (tokenizing,
    signals, score and spans), the time inside the model's forward (with the attention capture and what runs in
    it), the time outside it (everything else), and a plain forward of the same padded batches (the model's own
    SDPA forward, one logit per answer: the floor). Issue 35's CPU target: outside <= 5 % of inside at batch 32.
    ``samples``: other answers to time instead (``n`` is then their number)."""
    sm = pipeline.scorer.model
    samples, views = _by_length(pipeline.scorer, seeded_sample(n, seed) if samples is None else samples)
    n = len(samples)
    rows = []
    for size in batches:
        throughput(pipeline, samples[:2], size)  # warm-up
        clock = ForwardClock(sm.model)
        try:
            total = n / throughput(pipeline, samples, size)
        finally:
            clock.close()
        batched = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
        plain_s = median_seconds(lambda: plain_forward(sm, views, batched), 1, warm_up=False)
        row = {"batch": size, "answers": n, "total_s": total / n, "inside_s": clock.seconds / n,
               "outside_s": (total - clock.seconds) / n, "plain_forward_s": plain_s / n}
        row["outside_share"] = row["outside_s"] / row["inside_s"]
        row["over_plain"] = row["total_s"] / row["plain_forward_s"]
        rows.append(row)
    out(f"\n{pipeline.detector.name} on {n} answers, seconds per answer ({sm.device}, {sm.dtype}):")
    out("| batch | whole path | inside the forward | outside it | outside / inside | plain forward | whole / plain |")
    out("|---|---|---|---|---|---|---|")
    for r in rows:
        out(f"| {r['batch']} | {r['total_s']:.4f} | {r['inside_s']:.4f} | {r['outside_s']:.4f} | "
            f"{100 * r['outside_share']:.1f} % | {r['plain_forward_s']:.4f} | {r['over_plain']:.2f}x |")
    return rows


def batched_rate(pipeline, n: int | None = None, repeats: int = 3, seed: int = 0, out=print, samples=None,
                 processes: int = 1) -> dict:
    """Answers per second of the detector's whole scoring path over ``n`` RAGTruth test answers (a seeded sample;
    all of them with ``None``) in the scorer's own batches (``--batch-size auto``: sorted by length, as many as fit
    its token budget), against a plain forward of the same padded batches (the model's SDPA forward, one logit per
    answer: what the GPU could do). The median of ``repeats`` runs after a warm-up. Issue 35's GPU target: at
    least 500 answers/s on one H100 and at least half the plain forward's rate.

    ``processes``: that many processes share the device, each with its own model and the default detector, each
    scoring all the answers ``repeats`` times at once after all have warmed up (as ``--ray-actors N --ray-gpus
    1/N`` deploys them): the answers of all of them over the time from the first start to the last end. The host's
    work per answer is Python, one core per process; with several processes the device's queue stays full."""
    scorer = pipeline.scorer
    sm = scorer.model
    given = samples
    samples, views = _by_length(scorer, seeded_sample(n, seed) if given is None else given)
    if processes > 1:
        whole = _rate_of_processes(sm, processes, samples, repeats)
    else:
        throughput(pipeline, samples[:8], None)  # warm-up
        whole = sorted(throughput(pipeline, samples, None) for _ in range(repeats))[repeats // 2]
    batches = scorer.batches([len(v.input_ids) for v in views], None)
    forward_rate = len(samples) / median_seconds(lambda: plain_forward(sm, views, batches), repeats)
    row = {"answers": len(samples), "batches": len(batches), "processes": processes, "answers_per_s": whole,
           "plain_forward_answers_per_s": forward_rate, "ratio": whole / forward_rate}
    who = f"{processes} processes together" if processes > 1 else "one process"
    what = "RAGTruth test answers" if given is None else "given answers"
    out(f"\n{pipeline.detector.name} on {len(samples)} {what} in {len(batches)} batches (--batch-size auto; "
        f"{sm.device}, {sm.dtype}), {who}: {whole:.1f} answers/s; a plain forward of the same batches: "
        f"{forward_rate:.1f} answers/s; whole path / plain forward: {row['ratio']:.2f}")
    return row


def _rate_of_processes(sm, processes: int, samples: list, repeats: int) -> float:
    """:func:`batched_rate`'s answers/s of ``processes`` processes sharing ``sm``'s device: each says when it is
    warm, all start together, each reports its span. A process that fails, or dies before it reports (a script
    that starts this without ``if __name__ == "__main__"``: each new interpreter runs it again), stops the measure
    with what it said, never a wait."""
    import multiprocessing

    import torch

    from halwatch.models import registry

    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter each: no CUDA state forked
    go, messages = ctx.Event(), ctx.Queue()
    model = sm.name if sm.name in registry.MODELS else sm.path
    threads = max(1, torch.get_num_threads() // processes)  # on a CPU, each its share of the cores
    workers = [ctx.Process(target=_score_in_process, args=(model, str(sm.device), sm.dtype, samples, repeats,
                                                          threads, 1 / processes, go, messages), daemon=True)
               for _ in range(processes)]

    def gather(what: str) -> list:
        got = []
        while len(got) < processes:
            try:
                message = messages.get(timeout=1)
            except queue.Empty:
                dead = [w.exitcode for w in workers if w.exitcode is not None]
                if dead and messages.empty():
                    raise RuntimeError(f"a scoring process ended with exit code {dead[0]} before it {what}") from None
                continue
            if isinstance(message, str):
                raise RuntimeError(f"a scoring process failed: {message}")
            got.append(message)
        return got

    for w in workers:
        w.start()
    try:
        gather("was ready")
        go.set()
        spans = gather("reported its time")
    finally:
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.kill()
    return sum(count for _, _, count in spans) / (max(end for _, end, _ in spans) - min(start for start, _, _ in spans))


def _score_in_process(model: str, device: str, dtype: str, samples: list, repeats: int, threads: int,
                      share: float, go, messages) -> None:
    """One of :func:`_rate_of_processes`' processes, with ``threads`` CPU threads and ``share`` of its GPU's memory:
    puts ``None`` once warm, then ``(start, end, answers scored)``; or the line of the error that stopped it."""
    import logging

    import torch

    from halwatch.models.loader import load_model, share_device

    torch.set_num_threads(threads)
    logging.getLogger("halwatch").setLevel(logging.ERROR)
    try:
        sm = load_model(model, device=device, dtype=dtype)
        share_device(sm, share)
        pipeline = default_pipeline(sm)
        samples, _ = _by_length(pipeline.scorer, samples)
        throughput(pipeline, samples[:8], None)  # warm-up
        messages.put(None)
        go.wait()
        start = time.time()
        for _ in range(repeats):
            throughput(pipeline, samples, None)
        messages.put((start, time.time(), repeats * len(samples)))
    except Exception as exc:
        messages.put(f"{type(exc).__name__}: {first_line(exc)}")


#: What :func:`phases` reports: ``(label, the step's mark)`` (:func:`halwatch.timing.timed`); an indented label runs
#: inside the one above.
PHASES = (
    ("tokenizing", "tokenizing"),
    ("forward pass with the capture", "forward pass"),
    ("  the capture's last step: Prim's algorithm left, results per answer", "capture: assemble"),
    ("  token statistics, hidden states", "token statistics, hidden states"),
    ("  copies off the device", "copies off the device"),
    ("  lexical support (while the device finishes the batch)", "lexical support"),
    ("detector: scores and spans", "detector: scores and spans"),
    ("  token features", "token features"),
    ("  token model", "token model"),
    ("  answer features", "answer features"),
)


def phases(pipeline, n: int | None = None, batch_size: int | None = None, seed: int = 0, out=print,
           samples=None) -> dict:
    """Where the whole scoring path's time goes: each of :data:`PHASES` timed (:class:`halwatch.timing.Timer`, the
    device synchronised before and after each step) over one pass of ``n`` RAGTruth test answers (a seeded sample;
    all with ``None``) in batches of ``batch_size`` (``None``: the scorer's token budget), after a warm-up on eight
    of them; milliseconds per answer. The timers wait for the device, so the pass runs slower than without them:
    read the shares, not the rate."""
    from halwatch.timing import Timer

    samples = list(seeded_sample(n, seed) if samples is None else samples)
    throughput(pipeline, samples[:8], batch_size)  # warm-up
    with Timer(sync) as timer:
        rate = throughput(pipeline, samples, batch_size)
    spent = {label: timer.spent.get(mark, 0.0) for label, mark in PHASES}
    sm = pipeline.scorer.model
    out(f"\n{pipeline.detector.name} on {len(samples)} RAGTruth test answers, batches of "
        f"{batch_size or 'the token budget'} ({sm.device}, {sm.dtype}): {rate:.1f} answers/s with the timers on, "
        f"{1e3 / rate:.2f} ms per answer")
    out("| phase | ms per answer |")
    out("|---|---|")
    for label, seconds in spent.items():
        out(f"| {label.replace('  ', '- ')} | {1e3 * seconds / len(samples):.2f} |")
    return {"answers": len(samples), "answers_per_s": rate,
            "ms_per_answer": {label.strip(): 1e3 * s / len(samples) for label, s in spent.items()}}


def run_speed(model: str = "smollm2-135m", lengths=(256, 512, 1024), repeats: int = 3, out=print,
              device: str = "auto", dtype: str = "auto", answers: int = 32, parts=("lengths", "split"),
              batches=(1, 8, 32), batched_answers: int | None = None, phase_batch: int | None = None,
              processes: int = 1) -> dict:
    import logging

    import torch

    from halwatch.models.loader import load_model

    logging.getLogger("halwatch").setLevel(logging.ERROR)  # the cut-prompt warnings are expected here
    if "peer" in parts:  # two whole processes of their own: nothing loaded here
        from halwatch.eval.peer_speed import run_peer_speed

        peer = run_peer_speed(batched_answers or 50, out=out)
        parts = [p for p in parts if p != "peer"]
        if not parts:
            return {"model": model, "peer": peer}
    shared = load_model(model, device=device, dtype=dtype)
    where = f"{shared.device}, {shared.dtype}"
    if shared.device.type == "cuda":
        where += f", {torch.cuda.get_device_name(shared.device)}"
    results = {"model": model, "device": where}
    default = default_pipeline(shared)
    if "lengths" in parts:
        peak_ours = results["peak_rss_mb_ours"] = length_table(shared, default, lengths, repeats, results, out)
        if answers:
            rates = results["answers_per_s"] = answers_per_second(default, answers)
            out(f"default detector on {answers} RAGTruth test answers: {rates['one_at_a_time']:.2f} answers/s one "
                f"at a time, {rates['batched']:.2f} answers/s in batches of similar length (--batch-size auto)")
    else:
        out(f"model {model} on {where} ({torch.get_num_threads()} CPU threads)")
    if "split" in parts:
        results["split"] = forward_split(default, answers, batches, out=out)
    if "batched" in parts:
        results["batched"] = batched_rate(default, batched_answers, repeats, out=out, processes=processes)
    if "phases" in parts:
        results["phases"] = phases(default, batched_answers, phase_batch, out=out)
    if "evidence" in parts:
        from halwatch.eval.evidence_speed import evidence_cost

        results["evidence"] = evidence_cost(default, batched_answers or answers, repeats, out=out)
    if "adapter" in parts:
        from halwatch.eval.adapter_speed import adapter_cost

        results["adapter"] = adapter_cost(default, batched_answers or answers, repeats, out=out)
    if "lengths" not in parts:
        return results
    out(f"peak RSS before any eager run (our capture path, all lengths): {peak_ours:.0f} MB; "
        f"after the eager runs: {_peak_rss_mb():.0f} MB")
    if shared.device.type == "cuda":
        results["peak_gpu_mb"] = torch.cuda.max_memory_allocated(shared.device) / 2**20
        out(f"peak GPU memory allocated: {results['peak_gpu_mb']:.0f} MB")
    out("plain: SDPA forward, one logit; HF fwd: model(input_ids) as transformers runs it (SDPA, the logits of every "
        "position); +stats: response log-probs and entropies; +capture all heads: also the response-token "
        "attention rows of every head; TOHA: forward + capture + MTop-Div of the default TOHA artifact's heads; "
        f"default: scoring with the shipped default ({default.detector.name}): its signals, score and spans; eager: "
        "transformers' output_attentions=True (all maps)")
    return results


def length_table(shared, default, lengths, repeats: int, results: dict, out=print) -> float:
    """The table of forward times by input length (plain, transformers' own, with token statistics, capturing every
    head, TOHA's heads, the shipped default, eager attention maps) with the load times and ripser's check, into
    ``results``; the peak memory (MB) before any eager run."""
    import torch

    from halwatch.models import forward
    from halwatch.models.signal_types import SignalRequest
    from halwatch.scorer import Scorer

    model, where = results["model"], results["device"]
    t_import, t_first, t_again = _load_seconds(model, str(shared.device), shared.dtype)
    out(f"model {model} on {where} ({torch.get_num_threads()} CPU threads): import torch+transformers "
        f"{t_import:.2f} s; load from cache {t_first:.2f} s in a fresh process (with transformers' lazy imports), "
        f"{t_again:.2f} s once those are imported")
    samples = speed_samples(lengths)
    results.update(import_s=t_import, load_s=t_first, reload_s=t_again, threads=torch.get_num_threads(), lengths={})
    scorers = {n: Scorer(model=shared, max_tokens=n, cache=None) for n in lengths}
    for n in lengths:  # our paths first, for all lengths, so that their peak memory is not the eager runs'
        scorer = scorers[n]
        sm = scorer.model
        view = scorer.encode(samples[n])
        row = {"tokens": len(view.input_ids), "response_tokens": view.n_response}
        for key, request in (("plain_s", SignalRequest()), ("stats_s", SignalRequest(token_stats=True)),
                             ("capture_all_s", SignalRequest(token_stats=True, heads=sm.all_heads()))):
            row[key] = median_seconds(lambda: forward.run(sm, [view], request), repeats)
        row["view"] = view
        results["lengths"][n] = row
    heads = toha_heads(shared.name)
    toha_request = SignalRequest(heads=tuple(heads), reducers=("mtopdiv",))
    for n in lengths:
        row = results["lengths"][n]
        view = row["view"]
        row["toha_s"] = median_seconds(lambda: forward.run(shared, [view], toha_request), repeats)

        def hf_forward():
            with torch.inference_mode():
                shared.model(input_ids=torch.tensor([view.input_ids], device=shared.device), use_cache=False)

        row["hf_s"] = median_seconds(hf_forward, repeats)
        row["default_s"] = median_seconds(lambda: default.score([[view]]), repeats)
    peak_ours = _peak_rss_mb()
    toha_col = f"TOHA {len(heads)} heads"
    out(f"{'tokens':>6} {'resp':>5} {'plain':>8} {'HF fwd':>8} {'+stats':>8} {'+capture all heads':>19} "
        f"{toha_col:>14} {'TOHA/plain':>10} {'default':>9} {'default/HF':>10} {'eager attn maps':>16}")
    for n in lengths:
        row = results["lengths"][n]
        sm = scorers[n].model
        view = row.pop("view")
        ids = torch.tensor([view.input_ids], device=sm.device)
        if n == max(lengths):
            rows = forward.run(sm, [view], SignalRequest(heads=tuple(heads), keep_attention=True))[0].attention
            results["ripser"] = ripser_comparison(rows, view.n_prompt, out)

        def eager():
            with torch.inference_mode():
                sm.model(input_ids=ids, output_attentions=True, use_cache=False)

        sm.model.set_attn_implementation("eager")
        try:
            row["eager_s"] = median_seconds(eager, repeats)
        finally:
            forward.install(sm.model)
        out(f"{row['tokens']:>6} {row['response_tokens']:>5} {row['plain_s']:>7.2f}s {row['hf_s']:>7.2f}s "
            f"{row['stats_s']:>7.2f}s {row['capture_all_s']:>18.2f}s {row['toha_s']:>13.2f}s "
            f"{row['toha_s'] / row['plain_s']:>9.2f}x {row['default_s']:>8.2f}s "
            f"{row['default_s'] / row['hf_s']:>9.2f}x {row['eager_s']:>15.2f}s")
    return peak_ours
