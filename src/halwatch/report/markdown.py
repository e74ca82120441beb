"""The report as Markdown with its figures as PNG files beside it (``NAME-scores.png``, ...), for a CI log or a
pull request."""

from __future__ import annotations

from pathlib import Path

from halwatch.plots import png
from halwatch.report.figures import draw
from halwatch.report.summary import Share, Summary


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _share_table(rows: list[Share], first: str, labelled: bool) -> list[str]:
    head = [first, "answers", "flagged", "share flagged", "95 % interval", "mean score"] + (["AUROC"] if labelled
                                                                                          else [])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in rows:
        low, high = s.interval
        cells = [_cell(s.name), str(s.n), str(s.flagged), _pct(s.share), f"{_pct(low)} to {_pct(high)}",
                 f"{s.mean_score:.3f}"] + (["-" if s.auroc is None else f"{s.auroc:.3f}"] if labelled else [])
        out.append("| " + " | ".join(cells) + " |")
    return out


def _answer(item) -> list[str]:
    r, sample = item.result, item.sample
    label = "" if item.label is None else f", labelled {'hallucinated' if item.label else 'grounded'}"
    lines = [f"- **{_cell(r.id)}**: score {r.score:.3f} ({'hallucinated' if r.hallucinated else 'supported'}, "
             f"threshold {r.threshold:.3f}{', task ' + r.task if r.task else ''}{label})"]
    if sample is not None:
        if sample.question:
            lines.append(f"  - question: {_cell(sample.question)}")
        text, at, marked = sample.response, 0, []
        for span in sorted(r.spans, key=lambda s: s.start):
            marked += [text[at:span.start], f"<mark>{text[span.start:span.end]}</mark> ({span.confidence:.2f})"]
            at = span.end
        lines.append(f"  - answer: {_cell(''.join(marked) + text[at:])}")
    else:
        lines.append("  - flagged: " + (", ".join(f"<mark>{_cell(s.text)}</mark> ({s.confidence:.2f})"
                                                  for s in r.spans) or "no span"))
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
    lines = [f"# {title}", "", f"**{o.n}** answers, **{o.flagged}** flagged as hallucinated: **{_pct(o.share)}** "
             f"(95 % interval {_pct(low)} to {_pct(high)}); mean score {o.mean_score:.3f}.", "",
             " ".join(figures.values()), ""]
    for name, rows in summary.breakdowns.items():
        lines += [f"## By {name}", "", *_share_table(rows, name, labelled), ""]
    if labelled:
        m = summary.labelled
        lines += ["## Against the labels", "", "| answers with a label | hallucinated | AUROC | FPR | TPR | F1 | ECE |",
                  "|---|---|---|---|---|---|---|",
                  f"| {m['answers']} | {m['hallucinated']} | {m['auroc']:.3f} | {m['fpr']:.3f} | {m['tpr']:.3f} | "
                  f"{m['f1']:.3f} | {m['ece']:.3f} |", "",
                  "The threshold `halwatch calibrate --target-fpr RATE` would pick on these answers (in sample):", "",
                  "| --target-fpr | threshold | FPR here | TPR here |", "|---|---|---|---|",
                  *(f"| {t['target_fpr']} | {t['threshold']:.3f} | {t['fpr']:.3f} | {t['tpr']:.3f} |"
                    for t in m["targets"]), ""]
    lines += ["## Read first: the highest scores", ""]
    lines += [line for s in summary.first["highest"] for line in _answer(s)]
    if summary.first["uncertain"]:
        lines += ["", "## Read first: the verdicts nearest their threshold", ""]
        lines += [line for s in summary.first["uncertain"] for line in _answer(s)]
    lines += ["", "## What produced it", "", *(f"- {k.replace('_', ' ')}: {_cell(v)}"
                                               for k, v in summary.produced_by.items()), ""]
    files[path.name] = "\n".join(lines).encode("utf-8")
    return files
