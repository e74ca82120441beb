"""The figures of a report, computed once for every layout: the share of answers flagged with its interval, the
same by task and by each ``--by`` field, the scores' spread, the metrics where the answers carry labels, and the
answers to read first."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from halwatch.report.records import Scored

#: The false-positive rates at which the report says which threshold ``halwatch calibrate --target-fpr`` picks.
TARGET_RATES = (0.05, 0.1, 0.2)
#: Answers listed in each "read first" list.
READ_FIRST = 10
#: Groups listed per breakdown; the rest are summed into one row.
MAX_GROUPS = 20
#: z of a two-sided 95 % interval.
Z95 = 1.959963984540054


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a share ``k / n`` (95 % by default)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class Share:
    """Answers flagged among ``n``: the share and its 95 % Wilson interval; with the mean score."""

    name: str
    n: int
    flagged: int
    mean_score: float
    auroc: float | None = None

    @property
    def share(self) -> float:
        return self.flagged / self.n

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.flagged, self.n)


@dataclass
class Summary:
    """Everything a report shows (see the module docstring)."""

    items: list[Scored]
    overall: Share
    breakdowns: dict[str, list[Share]]
    thresholds: list[float]
    labelled: dict | None
    first: dict[str, list[Scored]]
    produced_by: dict = field(default_factory=dict)

    @property
    def scores(self) -> np.ndarray:
        return np.array([s.result.score for s in self.items])


def _share(name: str, items: list[Scored]) -> Share:
    labels = [s.label for s in items]
    auroc = None
    known = [(s.result.score, y) for s, y in zip(items, labels) if y is not None]
    if len({y for _, y in known}) == 2:
        from sklearn.metrics import roc_auc_score

        auroc = float(roc_auc_score([y for _, y in known], [p for p, _ in known]))
    return Share(name, len(items), sum(s.result.hallucinated for s in items),
                 float(np.mean([s.result.score for s in items])), auroc)


def breakdown(items: list[Scored], by: str) -> list[Share]:
    """One :class:`Share` per value of field ``by`` (most answers first; past :data:`MAX_GROUPS` the rest in one
    row named ``other``)."""
    groups: dict[str, list[Scored]] = {}
    for s in items:
        groups.setdefault(s.field(by), []).append(s)
    names = sorted(groups, key=lambda g: (-len(groups[g]), g))
    rows = [_share(g, groups[g]) for g in names[:MAX_GROUPS]]
    rest = [s for g in names[MAX_GROUPS:] for s in groups[g]]
    if rest:
        rows.append(_share(f"other ({len(names) - MAX_GROUPS} values)", rest))
    return rows


def labelled_metrics(items: list[Scored]) -> dict | None:
    """Where answers carry labels of both kinds: AUROC, FPR and TPR at each answer's own threshold, F1, the
    calibration error, and the threshold ``halwatch calibrate --target-fpr`` picks at each of :data:`TARGET_RATES`
    on these answers with the rates it reaches here (in sample); ``None`` otherwise."""
    from sklearn.metrics import f1_score, roc_auc_score

    from halwatch.detectors.operating import fpr_threshold
    from halwatch.eval.metrics import expected_calibration_error

    known = [s for s in items if s.label is not None]
    labels = np.array([s.label for s in known])
    if len(set(labels.tolist())) < 2:
        return None
    probs = np.array([s.result.score for s in known])
    flagged = np.array([s.result.hallucinated for s in known])
    out = {"answers": len(known), "hallucinated": int(labels.sum()), "auroc": float(roc_auc_score(labels, probs)),
           "fpr": float(flagged[labels == 0].mean()), "tpr": float(flagged[labels == 1].mean()),
           "f1": float(f1_score(labels, flagged)), "ece": expected_calibration_error(labels, probs),
           "labels": labels, "probs": probs, "targets": []}
    for rate in TARGET_RATES:
        t = fpr_threshold(probs, labels, rate)
        out["targets"].append({"target_fpr": rate, "threshold": t, "fpr": float((probs[labels == 0] >= t).mean()),
                               "tpr": float((probs[labels == 1] >= t).mean())})
    return out


def read_first(items: list[Scored], n: int = READ_FIRST) -> dict[str, list[Scored]]:
    """The answers to read first: the ``n`` highest scores, and the ``n`` nearest their threshold (the most
    uncertain verdicts) among the others."""
    ranked = sorted(items, key=lambda s: (-s.result.score, s.result.id))
    top = ranked[:n]
    chosen = {id(s) for s in top}
    near = sorted((s for s in items if id(s) not in chosen),
                  key=lambda s: (abs(s.result.score - s.result.threshold), s.result.id))[:n]
    return {"highest": top, "uncertain": near}


def summarise(items: list[Scored], by: tuple[str, ...] = (), produced_by: dict | None = None) -> Summary:
    """The :class:`Summary` of ``items``, broken down by task (where any answer has one) and by each ``by``
    field."""
    fields = (["task"] if any(s.result.task for s in items) else []) + [f for f in by if f != "task"]
    return Summary(items=items, overall=_share("all answers", items),
                   breakdowns={f: breakdown(items, f) for f in fields},
                   thresholds=sorted({s.result.threshold for s in items}),
                   labelled=labelled_metrics(items), first=read_first(items),
                   produced_by={**describe(items), **(produced_by or {})})


def describe(items: list[Scored]) -> dict:
    """What scored the answers, as the results say: detector, scoring model and input mode (each value with its
    count where several)."""
    out = {}
    for name in ("detector", "scoring_model", "input_mode"):
        counts = Counter(getattr(s.result, name) for s in items)
        out[name] = ", ".join(v if len(counts) == 1 else f"{v} ({c})" for v, c in counts.most_common())
    return out
