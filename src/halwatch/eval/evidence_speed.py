"""``halwatch bench speed --parts evidence``: what evidence (:mod:`halwatch.evidence`) adds to the default's time
per answer, answers scored one at a time as ``halwatch score`` scores them on a CPU (issue 76's target: at most
5 % for ``attention``)."""

from __future__ import annotations

import time


def evidence_cost(pipeline, n: int = 32, repeats: int = 3, modes=("attention",), out=print, samples=None) -> dict:
    """Seconds per answer of the whole scoring path without evidence and with each of ``modes``, on ``n`` real
    RAGTruth test answers (a seeded sample; ``samples``: others instead), one answer per pass; the settings take
    turns answer by answer, ``repeats`` times, after a warm-up, and each answer's median counts. Returns
    ``{"answers", "seconds": {setting: s/answer}, "added": {mode: share}}``."""
    import statistics

    from halwatch.data.ragtruth import seeded_sample
    from halwatch.timing import sync

    samples = seeded_sample(n, 0) if samples is None else samples
    answers = pipeline.encode(samples)
    settings = (None, *modes)
    for setting in settings:  # warm-up
        pipeline.score(answers[:2], batch_size=1, evidence=setting)
    times = {s: [[] for _ in answers] for s in settings}
    for _ in range(repeats):
        for i, views in enumerate(answers):
            for setting in settings:
                sync()
                t0 = time.perf_counter()
                pipeline.score([views], batch_size=1, evidence=setting)
                sync()
                times[setting][i].append(time.perf_counter() - t0)
    seconds = {s or "none": sum(statistics.median(t) for t in times[s]) / len(answers) for s in settings}
    added = {m: seconds[m] / seconds["none"] - 1 for m in modes}
    sm = pipeline.scorer.model
    out(f"\nevidence on {len(answers)} RAGTruth test answers, one per pass ({sm.device}, {sm.dtype}), seconds per "
        "answer:")
    out("| evidence | s / answer | added |")
    out("|---|---|---|")
    for setting, s in seconds.items():
        out(f"| {setting} | {s:.4f} | " + ("" if setting == "none" else f"{100 * added[setting]:+.1f} %") + " |")
    return {"answers": len(answers), "seconds": seconds, "added": added}
