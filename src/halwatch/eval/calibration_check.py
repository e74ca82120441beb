"""Does ``halwatch calibrate`` do what it says?

- ``--target-fpr`` (:func:`run_calibration_check`): for each dataset, its answers of one split are cut in two
  halves by source (seeded, so no source is on both sides); the detector is calibrated on one half and its false-
  and true-positive rates are measured on the other. Repeated over seeds.
- ``--prior estimate`` (:func:`run_prior_check`): how close the share of hallucinated answers estimated from
  unlabelled answers comes to the true one, and the calibration error before and after restating the
  probabilities for it; on each dataset's answers as they are and on resamples drawn at other shares.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

from halwatch.detectors.calibration import estimate_prior, estimated_share
from halwatch.errors import InputError
from halwatch.eval.datasets import load_dataset
from halwatch.eval.metrics import expected_calibration_error
from halwatch.eval.protocols import source_commit


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
    commit = source_commit()
    rows = []
    for name, samples, part, raw in _scored(detector, datasets, split, scorer_options):
        labels = np.array([s.label for s in samples])
        reached = []
        for seed in range(seeds):
            fit_part, check = halves(samples, seed)
            if max_answers and len(fit_part) > max_answers:
                fit_part = np.sort(np.random.default_rng(seed).choice(fit_part, max_answers, replace=False))
            det = copy.deepcopy(part)
            det.scorer = part.scorer
            det.recalibrate(raw[fit_part], labels[fit_part], target_fpr)
            flagged = det.calibrator.transform(raw[check]) >= det.threshold
            reached.append((flagged[labels[check] == 0].mean(), flagged[labels[check] == 1].mean(), len(fit_part)))
        fpr, tpr, n = (np.array(x, dtype=float) for x in zip(*reached))
        rows.append({"dataset": name, "split": split, "dtype": part.scorer.model.dtype, "target_fpr": target_fpr,
                     "seeds": seeds,
                     "answers_calibrated": int(np.median(n)), "fpr_mean": round(float(fpr.mean()), 4),
                     "fpr_sd": round(float(fpr.std()), 4), "gap_mean": round(float(np.abs(fpr - target_fpr).mean()), 4),
                     "within_0.05": round(float((np.abs(fpr - target_fpr) <= 0.05).mean()), 4),
                     "tpr_mean": round(float(tpr.mean()), 4)})
    print(f"halwatch calibrate --target-fpr {target_fpr}: calibrated on one half of each {split} split (by source), "
          f"checked on the other, {seeds} seeds; scored in {_precision(rows)}")
    print("| dataset | answers calibrated on | FPR reached (mean ± sd) | mean abs. gap | within 0.05 | TPR |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['dataset']} | {r['answers_calibrated']} | {r['fpr_mean']:.3f} ± {r['fpr_sd']:.3f} | "
              f"{r['gap_mean']:.3f} | {r['within_0.05']:.2f} | {r['tpr_mean']:.3f} |")
    _write(rows, out, commit)
    return rows


def _scored(detector: str, datasets, split: str, scorer_options: dict | None):
    """``(name, samples, part, raw)`` per dataset: its answers of ``split``, the part of ``detector`` that judges
    them (one per dataset: a detector with one part per task checks that task's part) and their raw scores as
    ``halwatch calibrate`` and ``score`` see them."""
    from halwatch.data.splits import split_of
    from halwatch.detectors import load_detector
    from halwatch.sample import task_of

    base = load_detector(detector, **(scorer_options or {"cache": True}))
    for name in datasets:
        samples = [s for s in load_dataset(name)[0] if split_of(s) == split]
        parts = {base.for_task(t) for t in {task_of(s) for s in samples}}  # (detectors hash by identity)
        if len(parts) != 1:
            raise InputError(f"{name}: answers judged by several parts of {detector}; check one task at a time")
        part = parts.pop()
        yield name, samples, part, part.answers(samples, progress=True)[1]


def _precision(rows: list[dict]) -> str:
    """The precision the rows were scored in, as the printed tables name it."""
    return ", ".join(sorted({r["dtype"] for r in rows})) or "-"


def _write(rows: list[dict], out, commit: str) -> None:
    """``rows`` as JSON to ``out``, each with the commit they were measured at and whether the tree was dirty."""
    for row in rows:
        row |= {"commit": commit, "dirty": commit.endswith("-dirty")}
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(rows, indent=1) + "\n")


def _as_prior(part, raw, prior: float) -> np.ndarray:
    """The probabilities ``part`` gives ``raw`` once they assume ``prior`` (a copy of its calibration restated)."""
    calibrator = copy.deepcopy(part.calibrator)
    calibrator.restate(float(prior))
    return calibrator.transform(raw)


def run_prior_check(detector: str = "default", datasets=("ragtruth:all",), split: str = "dev",
                    shares=(0.1, 0.26, 0.5, 0.8), draws: int = 30, size: int = 300, out=None,
                    scorer_options: dict | None = None) -> list[dict]:
    """Per dataset: the true share of hallucinated answers of ``split``, the share estimated from their scores
    alone (``halwatch calibrate --prior estimate``: :func:`~halwatch.detectors.base.estimated_share`) with its
    90 % bootstrap interval, and the expected calibration error as fitted, restated for the estimate and restated
    for the true share (the best restating can do); then the same on ``draws`` resamples of at most ``size``
    answers drawn at each of ``shares`` (the mean estimate, its spread and the mean errors). Prints tables; writes
    ``out`` (JSON) when given."""
    commit = source_commit()
    rows = []
    rng = np.random.default_rng(0)
    for name, samples, part, raw in _scored(detector, datasets, split, scorer_options):
        labels = np.array([s.label for s in samples])
        assumed, probs = part.assumed_prior(), part.calibrator.transform(raw)

        def errors(idx, estimate):
            return [expected_calibration_error(labels[idx], p) for p in
                    (probs[idx], _as_prior(part, raw[idx], estimate), _as_prior(part, raw[idx], labels[idx].mean()))]

        try:  # as halwatch calibrate --prior estimate would find it
            found = estimated_share(probs, assumed)
        except InputError as err:  # refused: an estimate at 0 or 1
            found = {"estimate": estimate_prior(probs, assumed), "interval": None, "refused": str(err)}
        fitted, restated, best = errors(np.arange(len(labels)), found["estimate"])
        row = {"dataset": name, "split": split, "dtype": part.scorer.model.dtype, "n": int(len(labels)),
               "assumed": round(assumed, 4),
               "share": round(float(labels.mean()), 4), "estimate": round(found["estimate"], 4),
               "interval": found["interval"] and [round(x, 4) for x in found["interval"]],
               "refused": found.get("refused"), "ece_fitted": round(fitted, 4),
               "ece_restated": None if found.get("refused") else round(restated, 4),
               "ece_true_share": round(best, 4), "resampled": []}
        pos, neg = np.flatnonzero(labels == 1), np.flatnonzero(labels == 0)
        for share in shares:
            n = int(min(size, len(pos) / share, len(neg) / (1 - share)))
            n_pos = int(round(n * share))
            found = []
            for _ in range(draws):
                idx = np.r_[rng.choice(pos, n_pos, replace=False), rng.choice(neg, n - n_pos, replace=False)]
                estimate = estimate_prior(probs[idx], assumed)
                found.append([estimate, *errors(idx, estimate)])
            found = np.array(found)
            row["resampled"].append({"share": share, "n": n, "estimate_mean": round(float(found[:, 0].mean()), 4),
                                     "estimate_sd": round(float(found[:, 0].std()), 4),
                                     "ece_fitted": round(float(found[:, 1].mean()), 4),
                                     "ece_restated": round(float(found[:, 2].mean()), 4),
                                     "ece_true_share": round(float(found[:, 3].mean()), 4)})
        rows.append(row)
    print(f"halwatch calibrate --prior estimate: the share of hallucinated answers estimated from unlabelled answers "
          f"({split} split), and the expected calibration error as fitted -> restated (restated for the true share); "
          f"scored in {_precision(rows)}")
    print("| dataset | answers | assumed | true share | estimate (90 % interval) | ECE fitted | restated | "
          "true share |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        interval = f"{r['interval'][0]:.3f}-{r['interval'][1]:.3f}" if r["interval"] else "refused"
        restated = "-" if r["ece_restated"] is None else f"{r['ece_restated']:.3f}"
        print(f"| {r['dataset']} | {r['n']} | {r['assumed']:.3f} | {r['share']:.3f} | {r['estimate']:.3f} "
              f"({interval}) | {r['ece_fitted']:.3f} | {restated} | {r['ece_true_share']:.3f} |")
    print(f"\nResampled at other shares ({draws} draws each): mean estimate ± sd; mean ECE fitted -> restated "
          f"(true share)")
    print("| dataset | share | answers | estimate | ECE fitted | restated | true share |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        for q in r["resampled"]:
            print(f"| {r['dataset']} | {q['share']:.2f} | {q['n']} | {q['estimate_mean']:.3f} ± {q['estimate_sd']:.3f} "
                  f"| {q['ece_fitted']:.3f} | {q['ece_restated']:.3f} | {q['ece_true_share']:.3f} |")
    _write(rows, out, commit)
    return rows
