"""The report's figures, drawn the one way halwatch draws a figure (:mod:`halwatch.plots`): the scores' spread with
the thresholds, and where the answers carry labels the ROC curve and the reliability diagram."""

from __future__ import annotations

from halwatch.plots import figure, reliability, roc, score_histogram
from halwatch.report.summary import Summary


def draw(summary: Summary, write) -> dict[str, str]:
    """Each figure of ``summary`` handed to ``write(fig, name)``, which returns how the page refers to it (inline
    SVG, a PNG's file name): ``{name: reference}``."""
    out = {}
    labels = [s.label for s in summary.items]
    with figure((6.4, 3.0)) as (fig, ax):
        score_histogram(ax, summary.scores, summary.thresholds, labels if any(y is not None for y in labels) else None)
        ax.set_title(f"scores of {len(summary.items)} answers", fontsize=9)
        out["scores"] = write(fig, "scores")
    metrics = summary.labelled
    if metrics is not None:
        with figure((3.6, 3.6)) as (fig, ax):
            roc(ax, {f"AUROC {metrics['auroc']:.3f}": (metrics["labels"], metrics["probs"])},
                f"ROC, {metrics['answers']} labelled answers")
            out["roc"] = write(fig, "roc")
        with figure((3.6, 3.6)) as (fig, ax):
            reliability(ax, metrics["labels"], metrics["probs"])
            ax.set_title(f"reliability (ECE {metrics['ece']:.3f})", fontsize=8)
            out["reliability"] = write(fig, "reliability")
    return out
