"""The report as one self-contained HTML page: every figure inline SVG, the style inline, no script and no network,
so that it opens offline in any browser."""

from __future__ import annotations

from html import escape

from halwatch.plots import svg
from halwatch.report.figures import draw
from halwatch.report.summary import Share, Summary

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
.muted{color:#777;font-size:.9em}
"""


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _share_row(s: Share, labelled: bool) -> str:
    low, high = s.interval
    cells = [escape(s.name), str(s.n), str(s.flagged), _pct(s.share), f"{_pct(low)} to {_pct(high)}",
             f"{s.mean_score:.3f}"]
    if labelled:
        cells.append("-" if s.auroc is None else f"{s.auroc:.3f}")
    return "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def _share_table(rows: list[Share], first: str, labelled: bool) -> str:
    head = [first, "answers", "flagged", "share flagged", "95 % interval", "mean score"] + (["AUROC"] if labelled
                                                                                          else [])
    return ("<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>"
            + "".join(_share_row(r, labelled) for r in rows) + "</table>")


def highlighted(response: str, spans) -> str:
    """The response with each flagged span in a ``<mark>`` whose title is its confidence (shown on hover)."""
    out, at = [], 0
    for span in sorted(spans, key=lambda s: s.start):
        out.append(escape(response[at:span.start]))
        out.append(f'<mark title="confidence {span.confidence:.2f}">{escape(response[span.start:span.end])}</mark>')
        at = span.end
    out.append(escape(response[at:]))
    return "".join(out)


def _answer(item) -> str:
    r, sample = item.result, item.sample
    verdict = ('<span class="flagged">hallucinated</span>' if r.hallucinated
               else '<span class="supported">supported</span>')
    label = "" if item.label is None else f" · labelled {'hallucinated' if item.label else 'grounded'}"
    head = (f'<div class="head">{escape(r.id)}: score {r.score:.3f} ({verdict}, threshold {r.threshold:.3f})'
            f'{escape(" · task " + r.task) if r.task else ""}{label}</div>')
    if sample is None:
        spans = ", ".join(f"<mark title=\"confidence {s.confidence:.2f}\">{escape(s.text)}</mark>" for s in r.spans)
        return (f'<div class="answer" data-id="{escape(r.id)}">{head}<div class="response">flagged: '
                f'{spans or "no span"}</div><div class="muted">give --input for the context and the whole '
                f"answer</div></div>")
    context = sample.context_text
    more = f" … ({len(context) - CONTEXT_CHARS} characters more)" if len(context) > CONTEXT_CHARS else ""
    question = f"<div><b>question:</b> {escape(sample.question)}</div>" if sample.question else ""
    return (f'<div class="answer" data-id="{escape(r.id)}">{head}'
            f'<div class="context"><b>context:</b> {escape(context[:CONTEXT_CHARS])}{escape(more)}</div>{question}'
            f'<div><b>answer:</b> <span class="response">{highlighted(sample.response, r.spans)}</span></div></div>')


def _labelled(metrics: dict) -> str:
    rows = [("answers with a label", str(metrics["answers"])), ("hallucinated", str(metrics["hallucinated"])),
            ("AUROC", f"{metrics['auroc']:.3f}"), ("FPR at the threshold", f"{metrics['fpr']:.3f}"),
            ("TPR at the threshold", f"{metrics['tpr']:.3f}"), ("F1", f"{metrics['f1']:.3f}"),
            ("calibration error (ECE)", f"{metrics['ece']:.3f}")]
    table = ("<table id=\"metrics\">" + "".join(f'<tr><td>{a}</td><td data-metric="{a}">{b}</td></tr>'
                                              for a, b in rows) + "</table>")
    targets = ("<table><tr><th>--target-fpr</th><th>threshold</th><th>FPR here</th><th>TPR here</th></tr>"
               + "".join(f"<tr><td>{t['target_fpr']}</td><td>{t['threshold']:.3f}</td><td>{t['fpr']:.3f}</td>"
                         f"<td>{t['tpr']:.3f}</td></tr>" for t in metrics["targets"]) + "</table>")
    return (f"<h2>Against the labels</h2>{table}<p>The threshold <code>halwatch calibrate --target-fpr RATE</code> "
            f"would pick on these answers, and the rates it reaches on them (in sample: set and read on the same "
            f"answers; on new ones the rates move):</p>{targets}")


def render(summary: Summary, title: str) -> str:
    """The whole page."""
    figures = draw(summary, lambda fig, name: f'<figure id="figure-{name}">{svg(fig)}</figure>')
    labelled = summary.labelled is not None
    o = summary.overall
    low, high = o.interval
    parts = [f"<h1>{escape(title)}</h1>",
             f'<p id="overall"><b>{o.n}</b> answers, <b>{o.flagged}</b> flagged as hallucinated: '
             f'<b data-share="{o.share:.6f}">{_pct(o.share)}</b> (95 % interval {_pct(low)} to {_pct(high)}); '
             f"mean score {o.mean_score:.3f}.</p>",
             '<div class="figures">' + "".join(figures.values()) + "</div>"]
    for name, rows in summary.breakdowns.items():
        parts.append(f"<h2>By {escape(name)}</h2>{_share_table(rows, name, labelled)}")
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
