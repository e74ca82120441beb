"""The report's tables and highlights as plain text cells, the same for every layout (:mod:`halwatch.report.html`
escapes them for HTML, :mod:`halwatch.report.markdown` for Markdown)."""

from __future__ import annotations

from halwatch.report.summary import Share


def percent(x: float) -> str:
    return f"{100 * x:.1f} %"


def share_columns(first: str, labelled: bool) -> list[str]:
    """The header of a table of :class:`Share` rows whose first column is named ``first``."""
    return [first, "answers", "flagged", "share flagged", "95 % interval", "mean score"] + (["AUROC"] if labelled
                                                                                          else [])


def share_cells(s: Share, labelled: bool) -> list[str]:
    """One :class:`Share` as the cells under :func:`share_columns` (text, not yet escaped for a layout)."""
    low, high = s.interval
    return [s.name, str(s.n), str(s.flagged), percent(s.share), f"{percent(low)} to {percent(high)}",
            f"{s.mean_score:.3f}"] + (["-" if s.auroc is None else f"{s.auroc:.3f}"] if labelled else [])


def metric_cells(metrics: dict) -> list[tuple[str, str]]:
    """``(name, value)`` of each figure of :func:`labelled_metrics`."""
    return [("answers with a label", str(metrics["answers"])), ("hallucinated", str(metrics["hallucinated"])),
            ("AUROC", f"{metrics['auroc']:.3f}"), ("FPR at the threshold", f"{metrics['fpr']:.3f}"),
            ("TPR at the threshold", f"{metrics['tpr']:.3f}"), ("F1", f"{metrics['f1']:.3f}"),
            ("calibration error (ECE)", f"{metrics['ece']:.3f}")]


#: The header of the table of thresholds ``halwatch calibrate --target-fpr`` would pick.
TARGET_COLUMNS = ("--target-fpr", "threshold", "FPR here", "TPR here")


def target_cells(metrics: dict) -> list[list[str]]:
    """The rows under :data:`TARGET_COLUMNS`."""
    return [[str(t["target_fpr"]), f"{t['threshold']:.3f}", f"{t['fpr']:.3f}", f"{t['tpr']:.3f}"]
            for t in metrics["targets"]]


def segments(text: str, spans) -> list[tuple[str, object]]:
    """``text`` cut at its flagged ``spans``: ``(piece, span)`` in order, ``span`` ``None`` for unflagged text."""
    out, at = [], 0
    for span in sorted(spans, key=lambda s: s.start):
        out += [(text[at:span.start], None), (text[span.start:span.end], span)]
        at = span.end
    return out + [(text[at:], None)]


def evidence_lines(result) -> list[str]:
    """One line per answer sentence of a result scored with evidence (``halwatch score --evidence``): the sentence,
    then its heaviest source in the context with its weight, or that it has none; no lines without evidence."""
    lines = []
    for sentence in result.evidence or ():
        if not sentence.supported:
            found = "no evidence (it holds flagged words)"
        elif sentence.sources:
            top = sentence.sources[0]
            found = f'"{top.text}" (weight {top.weight:.2f}' + (
                f", and {len(sentence.sources) - 1} more)" if len(sentence.sources) > 1 else ")")
        else:
            found = "no source in the context"
        lines.append(f'"{sentence.text}" <- {found}')
    return lines
