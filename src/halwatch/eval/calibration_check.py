"""Does ``halwatch calibrate`` hold the false-positive rate a user asks for? For each dataset, its answers of one
split are cut in two halves by source (seeded, so no source is on both sides); the detector is calibrated on one
half with ``--target-fpr`` and its false- and true-positive rates are measured on the other. Repeated over seeds.
"""

from __future__ import annotations

import copy

import numpy as np


def halves(samples, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of two halves of ``samples`` with no source on both sides (sources shuffled with ``seed``)."""
    sources = sorted({s.source for s in samples})
    rng = np.random.default_rng(seed)
    rng.shuffle(sources)
    first = set(sources[: len(sources) // 2])
    inside = np.array([s.source in first for s in samples])
    return np.flatnonzero(inside), np.flatnonzero(~inside)


def run_calibration_check(detector: str = "default", datasets=("squad-shapes",), split: str = "dev",
                          target_fpr: float = 0.1, seeds: int = 20, max_answers: int | None = 500, out=None,
                          scorer_options: dict | None = None) -> list[dict]:
    """Per dataset: the mean false-positive rate reached on the held-out half, the mean absolute gap to the target,
    the share of seeds within 0.05 of it, and the mean true-positive rate, each calibration on at most
    ``max_answers`` answers (a user's 50-500). Prints a table; writes ``out`` (JSON) when given."""
    import json
    from pathlib import Path

    from halwatch.data.splits import split_of
    from halwatch.detectors import DETECTORS, read_artifact
    from halwatch.errors import InputError
    from halwatch.eval.protocols import load_dataset
    from halwatch.sample import task_of
    from halwatch.scorer import Scorer

    artifact = read_artifact(detector)
    scorer = Scorer.from_options(identity=artifact, **(scorer_options or {}))
    base = DETECTORS[artifact["detector"]].from_dict(artifact, scorer=scorer)
    rows = []
    for name in datasets:
        samples = [s for s in load_dataset(name)[0] if split_of(s) == split]
        parts = {base.for_task(t) for t in {task_of(s) for s in samples}}  # (detectors hash by identity)
        if len(parts) != 1:
            raise InputError(f"{name}: answers judged by several parts of {detector}; check one task at a time")
        part = parts.pop()  # a detector with one part per task calibrates that task's part
        raw = part.answers(samples, progress=True)[1]  # as halwatch calibrate and score see them
        labels = np.array([s.label for s in samples])
        reached = []
        for seed in range(seeds):
            fit_part, check = halves(samples, seed)
            if max_answers and len(fit_part) > max_answers:
                fit_part = np.sort(np.random.default_rng(seed).choice(fit_part, max_answers, replace=False))
            det = copy.deepcopy(part)
            det.scorer = scorer
            det.recalibrate(raw[fit_part], labels[fit_part], target_fpr)
            flagged = det.calibrator.transform(raw[check]) >= det.threshold
            reached.append((flagged[labels[check] == 0].mean(), flagged[labels[check] == 1].mean(), len(fit_part)))
        fpr, tpr, n = (np.array(x, dtype=float) for x in zip(*reached))
        rows.append({"dataset": name, "split": split, "target_fpr": target_fpr, "seeds": seeds,
                     "answers_calibrated": int(np.median(n)), "fpr_mean": round(float(fpr.mean()), 4),
                     "fpr_sd": round(float(fpr.std()), 4), "gap_mean": round(float(np.abs(fpr - target_fpr).mean()), 4),
                     "within_0.05": round(float((np.abs(fpr - target_fpr) <= 0.05).mean()), 4),
                     "tpr_mean": round(float(tpr.mean()), 4)})
    print(f"halwatch calibrate --target-fpr {target_fpr}: calibrated on one half of each {split} split (by source), "
          f"checked on the other, {seeds} seeds")
    print("| dataset | answers calibrated on | FPR reached (mean ± sd) | mean abs. gap | within 0.05 | TPR |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['dataset']} | {r['answers_calibrated']} | {r['fpr_mean']:.3f} ± {r['fpr_sd']:.3f} | "
              f"{r['gap_mean']:.3f} | {r['within_0.05']:.2f} | {r['tpr_mean']:.3f} |")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(rows, indent=1) + "\n")
    return rows
