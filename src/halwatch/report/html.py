"""The report as one self-contained HTML page: every figure inline SVG, the style inline, no script and no network,
so that it opens offline in any browser."""

from __future__ import annotations

from html import escape

from halwatch.plots import svg
from halwatch.report import cells
from halwatch.report.figures import draw
from halwatch.report.summary import Summary

#: Characters of an answer's context shown beside it.
CONTEXT_CHARS = 600

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}.figures{display:flex;flex-wrap:wrap;gap:1em}
.figures svg{max-width:100%;height:auto}.answer{border:1px solid #ddd;border-radius:6px;padding:.6em 1em;margin:.8em 0}
.answer .head{font-weight:600}.flagged{color:#b00}.supported{color:#060}.context{color:#555;font-size:.9em;
white-space:pre-wrap}mark{background:#ffd0d0;border-bottom:2px solid #d33}.response{white-space:pre-wrap}
.muted{color:#777;font-size:.9em}.evidence{color:#345;font-size:.9em;margin:.3em 0}
"""


def _table(header, rows, attrs: str = "") -> str:
    return (f"<table{attrs}><tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>"
            + "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows) + "</table>")


def _mark(text: str, span) -> str:
    return f'<mark title="confidence {span.confidence:.2f}">{escape(text)}</mark>'


def highlighted(response: str, spans) -> str:
    """The response with each flagged span in a ``<mark>`` whose title is its confidence (shown on hover)."""
    return "".join(escape(piece) if span is None else _mark(piece, span)
                   for piece, span in cells.segments(response, spans))


def _answer(item) -> str:
    r, sample = item.result, item.sample
    verdict = ('<span class="flagged">hallucinated</span>' if r.hallucinated
               else '<span class="supported">supported</span>')
    label = "" if item.label is None else f" · labelled {'hallucinated' if item.label else 'grounded'}"
    head = (f'<div class="head">{escape(r.id)}: score {r.score:.3f} ({verdict}, threshold {r.threshold:.3f})'
            f'{escape(" · task " + r.task) if r.task else ""}{label}</div>')
    if sample is None:
        spans = ", ".join(_mark(s.text, s) for s in r.spans)
        return (f'<div class="answer" data-id="{escape(r.id)}">{head}<div class="response">flagged: '
                f'{spans or "no span"}</div><div class="muted">give --input for the context and the whole '
                f"answer</div></div>")
    context = sample.context_text
    more = f" … ({len(context) - CONTEXT_CHARS} characters more)" if len(context) > CONTEXT_CHARS else ""
    question = f"<div><b>question:</b> {escape(sample.question)}</div>" if sample.question else ""
    return (f'<div class="answer" data-id="{escape(r.id)}">{head}'
            f'<div class="context"><b>context:</b> {escape(context[:CONTEXT_CHARS])}{escape(more)}</div>{question}'
            f'<div><b>answer:</b> <span class="response">{highlighted(sample.response, r.spans)}</span></div>'
            f'{_evidence(r)}</div>')


def _evidence(result) -> str:
    lines = cells.evidence_lines(result)
    return ('<ul class="evidence">' + "".join(f"<li>{escape(line)}</li>" for line in lines) + "</ul>") if lines else ""


def _labelled(metrics: dict) -> str:
    table = ('<table id="metrics">' + "".join(f'<tr><td>{a}</td><td data-metric="{a}">{b}</td></tr>'
                                              for a, b in cells.metric_cells(metrics)) + "</table>")
    return (f"<h2>Against the labels</h2>{table}<p>The threshold <code>halwatch calibrate --target-fpr RATE</code> "
            f"would pick on these answers, and the rates it reaches on them (in sample: set and read on the same "
            f"answers; on new ones the rates move):</p>{_table(cells.TARGET_COLUMNS, cells.target_cells(metrics))}")


def render(summary: Summary, title: str) -> str:
    """The whole page."""
    figures = draw(summary, lambda fig, name: f'<figure id="figure-{name}">{svg(fig)}</figure>')
    labelled = summary.labelled is not None
    o = summary.overall
    low, high = o.interval
    parts = [f"<h1>{escape(title)}</h1>",
             f'<p id="overall"><b>{o.n}</b> answers, <b>{o.flagged}</b> flagged as hallucinated: '
             f'<b data-share="{o.share:.6f}">{cells.percent(o.share)}</b> (95 % interval {cells.percent(low)} to '
             f'{cells.percent(high)}); '
             f"mean score {o.mean_score:.3f}.</p>",
             '<div class="figures">' + "".join(figures.values()) + "</div>"]
    for name, rows in summary.breakdowns.items():
        table = _table(cells.share_columns(name, labelled), [cells.share_cells(r, labelled) for r in rows])
        parts.append(f"<h2>By {escape(name)}</h2>{table}")
    if labelled:
        parts.append(_labelled(summary.labelled))
    parts.append("<h2>Read first: the highest scores</h2>" + "".join(_answer(s) for s in summary.first["highest"]))
    if summary.first["uncertain"]:
        parts.append("<h2>Read first: the verdicts nearest their threshold</h2>"
                     + "".join(_answer(s) for s in summary.first["uncertain"]))
    parts.append("<h2>What produced it</h2><table>" + "".join(
        f"<tr><td>{escape(k.replace('_', ' '))}</td><td>{escape(str(v))}</td></tr>"
        for k, v in summary.produced_by.items()) + "</table>")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>\n")
