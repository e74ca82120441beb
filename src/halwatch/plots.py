"""The one way halwatch draws a figure: :func:`figure` opens a matplotlib figure (the non-interactive Agg backend,
closed when the block ends) and :func:`save`, :func:`svg` or :func:`png` write it out; the figures that the benchmark
reports (``report.md``) and the reports of a user's scored file (``halwatch report``) share are drawn here on a
given axis."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np

#: Resolution of every written PNG.
DPI = 110


@contextlib.contextmanager
def figure(size=(5.5, 4.0)):
    """``(fig, ax)`` of a new figure of ``size`` inches, closed when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    try:
        yield fig, ax
    finally:
        plt.close(fig)


def save(fig, path: str | Path) -> None:
    """Write ``fig`` as a PNG at ``path`` (laid out tight)."""
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def png(fig) -> bytes:
    """``fig`` as PNG bytes."""
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def svg(fig) -> str:
    """``fig`` as an inline ``<svg>`` element (no XML prolog, no external reference: it draws offline)."""
    import matplotlib

    buffer = io.StringIO()
    fig.tight_layout()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "halwatch"}):
        fig.savefig(buffer, format="svg", metadata={"Date": None})  # the same figure, the same text
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def roc(ax, curves: dict, title: str = "") -> None:
    """ROC curves: ``curves``: name -> ``(labels, scores)``; the chance diagonal dotted."""
    from sklearn.metrics import roc_curve

    for name, (labels, scores) in curves.items():
        fpr, tpr, _ = roc_curve(labels, scores)
        ax.plot(fpr, tpr, label=name)
    ax.plot([0, 1], [0, 1], "k:", lw=0.8)
    ax.set(xlabel="false positive rate", ylabel="true positive rate")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)


def score_histogram(ax, scores, thresholds, labels=None, bins: int = 40) -> None:
    """The distribution of ``scores`` (probabilities) with each threshold marked; stacked by label where
    ``labels`` (1 hallucinated, 0 grounded, ``None`` unknown) are given."""
    scores = np.asarray(scores, dtype=float)
    edges = np.linspace(0, 1, bins + 1)
    if labels is None:
        ax.hist(scores, bins=edges, color="#4c72b0")
    else:
        labels = np.asarray([-1 if v is None else v for v in labels])
        parts = [(scores[labels == 0], "grounded", "#4c72b0"), (scores[labels == 1], "hallucinated", "#dd5555"),
                 (scores[labels == -1], "no label", "#aaaaaa")]
        parts = [p for p in parts if len(p[0])]
        ax.hist([p[0] for p in parts], bins=edges, stacked=True, label=[p[1] for p in parts],
                color=[p[2] for p in parts])
        ax.legend(fontsize=7)
    for t in sorted(set(thresholds)):
        ax.axvline(t, color="k", ls="--", lw=1)
        ax.annotate(f"threshold {t:.3g}", (t, 1), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", fontsize=7)
    ax.set(xlabel="score (probability of hallucination)", ylabel="answers", xlim=(0, 1))


def reliability(ax, labels, probs, bins: int = 10) -> None:
    """A reliability diagram: the share of hallucinated answers in each of ``bins`` equal-width probability bins
    against the bin's mean probability (the diagonal is perfect calibration), each bin's answers as the marker's
    size; the same bins as :func:`halwatch.eval.metrics.expected_calibration_error`."""
    labels, probs = np.asarray(labels, dtype=float), np.asarray(probs, dtype=float)
    index = np.minimum((probs * bins).astype(int), bins - 1)
    mean_prob, share, count = [], [], []
    for b in range(bins):
        mine = index == b
        if mine.any():
            mean_prob.append(probs[mine].mean())
            share.append(labels[mine].mean())
            count.append(int(mine.sum()))
    ax.plot([0, 1], [0, 1], "k:", lw=0.8)
    ax.plot(mean_prob, share, "-", color="#4c72b0", lw=1)
    ax.scatter(mean_prob, share, s=[12 + 120 * c / max(count) for c in count], color="#4c72b0", zorder=3)
    ax.set(xlabel="mean score in the bin", ylabel="share hallucinated", xlim=(0, 1), ylim=(0, 1))
