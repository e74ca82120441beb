"""``halwatch bench speed --parts adapter``: what running the adapter (:mod:`halwatch.models.adapter`) in the pass
adds to the default's time per answer, answers scored one at a time as ``halwatch score`` scores them on a CPU
(issue 75's target: the whole default at most 1.2x). The adapter's cost does not depend on its trained values: a
fresh adapter of the model's default layers is timed where the default has none."""

from __future__ import annotations

import time


def adapter_cost(pipeline, n: int = 32, repeats: int = 3, out=print, samples=None) -> dict:
    """Seconds per answer of the whole scoring path (the default as shipped), of its pass, and of its pass with the
    adapter, on ``n`` real RAGTruth test answers (a seeded sample; ``samples``: others instead), one answer per pass;
    the three take turns answer by answer, ``repeats`` times, after a warm-up, and each answer's median counts.
    Returns ``{"answers", "seconds": {what: s/answer}, "added": share of the whole path}``."""
    import dataclasses
    import statistics

    from halwatch.data.ragtruth import seeded_sample
    from halwatch.models import adapter as adapter_lib
    from halwatch.models import forward
    from halwatch.models.signal_types import SignalRequest
    from halwatch.timing import sync

    samples = seeded_sample(n, 0) if samples is None else samples
    answers = pipeline.encode(samples)
    sm = pipeline.scorer.model
    request = pipeline.detector.request()
    if request.adapter is None:
        start, depth = adapter_lib.default_layers(sm.n_layers)
        fresh = adapter_lib.new_adapter(sm.model, start, depth)
        with_adapter = request.merge(SignalRequest(adapter=adapter_lib.AdapterRequest.of(
            fresh.arrays(), start, depth, fresh.rank, fresh.alpha)))
    else:
        with_adapter, request = request, dataclasses.replace(request, adapter=None)
    runs = {"whole default": lambda views: pipeline.score([views], batch_size=1),
            "pass": lambda views: forward.run(sm, views, request),
            "pass with the adapter": lambda views: forward.run(sm, views, with_adapter)}
    for run in runs.values():  # warm-up
        run(answers[0])
    times = {name: [[] for _ in answers] for name in runs}
    for _ in range(repeats):
        for i, views in enumerate(answers):
            for name, run in runs.items():
                sync()
                t0 = time.perf_counter()
                run(views)
                sync()
                times[name][i].append(time.perf_counter() - t0)
    seconds = {name: sum(statistics.median(t) for t in times[name]) / len(answers) for name in runs}
    added = (seconds["pass with the adapter"] - seconds["pass"]) / seconds["whole default"]
    out(f"\nthe adapter on {len(answers)} RAGTruth test answers, one per pass ({sm.device}, {sm.dtype}), seconds per "
        "answer:")
    out("| run | s / answer |")
    out("|---|---|")
    for name, s in seconds.items():
        out(f"| {name} | {s:.4f} |")
    out(f"the adapter adds {100 * added:+.1f} % to the whole default's time per answer")
    return {"answers": len(answers), "seconds": seconds, "added": added}
