"""The report as Markdown with its figures as PNG files beside it (``NAME-scores.png``, ...), for a CI log or a
pull request."""

from __future__ import annotations

from pathlib import Path

from halwatch.plots import png
from halwatch.report import cells
from halwatch.report.figures import draw
from halwatch.report.summary import Summary


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _table(header, rows) -> list[str]:
    return (["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows])


def _mark(text: str, span) -> str:
    return f"<mark>{text}</mark> ({span.confidence:.2f})"


def _answer(item) -> list[str]:
    r, sample = item.result, item.sample
    label = "" if item.label is None else f", labelled {'hallucinated' if item.label else 'grounded'}"
    lines = [f"- **{_cell(r.id)}**: score {r.score:.3f} ({'hallucinated' if r.hallucinated else 'supported'}, "
             f"threshold {r.threshold:.3f}{', task ' + r.task if r.task else ''}{label})"]
    if sample is not None:
        if sample.question:
            lines.append(f"  - question: {_cell(sample.question)}")
        marked = "".join(piece if span is None else _mark(piece, span)
                         for piece, span in cells.segments(sample.response, r.spans))
        lines.append(f"  - answer: {_cell(marked)}")
        lines += [f"  - sources: {_cell(line)}" for line in cells.evidence_lines(r)]
    else:
        lines.append("  - flagged: " + (", ".join(_mark(_cell(s.text), s) for s in r.spans) or "no span"))
    return lines


def render(summary: Summary, title: str, path: Path) -> dict[str, bytes]:
    """``{file name: bytes}`` of the Markdown page (at ``path``) and its PNG figures beside it."""
    files: dict[str, bytes] = {}

    def write(fig, name):
        files[f"{path.stem}-{name}.png"] = png(fig)
        return f"![{name}]({path.stem}-{name}.png)"

    figures = draw(summary, write)
    labelled = summary.labelled is not None
    o = summary.overall
    low, high = o.interval
    lines = [f"# {title}", "", f"**{o.n}** answers, **{o.flagged}** flagged as hallucinated: "
             f"**{cells.percent(o.share)}** (95 % interval {cells.percent(low)} to {cells.percent(high)}); mean score "
             f"{o.mean_score:.3f}.", "",
             " ".join(figures.values()), ""]
    for name, rows in summary.breakdowns.items():
        rows = [cells.share_cells(r, labelled) for r in rows]
        lines += [f"## By {name}", "", *_table(cells.share_columns(name, labelled), rows), ""]
    if labelled:
        m = summary.labelled
        figures_of = cells.metric_cells(m)
        lines += ["## Against the labels", "", *_table([a for a, _ in figures_of], [[b for _, b in figures_of]]), "",
                  "The threshold `halwatch calibrate --target-fpr RATE` would pick on these answers (in sample):", "",
                  *_table(cells.TARGET_COLUMNS, cells.target_cells(m)), ""]
    lines += ["## Read first: the highest scores", ""]
    lines += [line for s in summary.first["highest"] for line in _answer(s)]
    if summary.first["uncertain"]:
        lines += ["", "## Read first: the verdicts nearest their threshold", ""]
        lines += [line for s in summary.first["uncertain"] for line in _answer(s)]
    lines += ["", "## What produced it", "", *(f"- {k.replace('_', ' ')}: {_cell(v)}"
                                               for k, v in summary.produced_by.items()), ""]
    files[path.name] = "\n".join(lines).encode("utf-8")
    return files
