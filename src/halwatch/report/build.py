"""One report from one scored file: read and check every record first, then write the page (and its figures)
whole, so that a bad record stops the command with nothing written."""

from __future__ import annotations

from pathlib import Path

from halwatch.errors import InputError
from halwatch.files import replaced
from halwatch.report.records import joined, read_scored
from halwatch.report.summary import Summary, summarise

FORMATS = ("html", "md")


def format_of(output: str | Path, given: str | None = None) -> str:
    """The format asked for, else the output's suffix (``.md``: Markdown), else HTML."""
    if given is not None:
        if given not in FORMATS:
            raise InputError(f"unknown report format {given!r}: choose one of {', '.join(FORMATS)}")
        return given
    return "md" if Path(output).suffix.lower() in (".md", ".markdown") else "html"


def build(scored: str | Path, output: str | Path, input_path: str | Path | None = None, by=(),
          fmt: str | None = None, title: str | None = None, command: str | None = None) -> Summary:
    """Write the report of ``scored`` (``halwatch score``'s JSONL) to ``output``: HTML (one self-contained file) or
    Markdown (with PNG figures beside it, named after it). ``input_path``: the file that was scored (context,
    question, response, label and ``meta`` of each answer, joined by id); ``by``: fields to break the flagged share
    down by (a result field such as ``detector``, or a ``meta`` key of the input). Returns the summary."""
    from halwatch import __version__

    fmt = format_of(output, fmt)
    output = Path(output)
    if not output.parent.is_dir():
        raise InputError("no such folder for the report", str(output.parent))
    items = joined(read_scored(scored), input_path)
    for name in by:
        if all(s.field(name) == "-" for s in items):
            raise InputError(f"--by {name}: no answer has this field (a field of the results, or a meta key of "
                             f"the records of --input)")
    summary = summarise(items, tuple(by), {
        "precision": "not recorded in the scored lines (halwatch score --dtype)",
        "halwatch": __version__, "command": command or "-", "scored file": str(scored),
        "input": str(input_path) if input_path else "-"})
    title = title or f"halwatch report: {Path(scored).name}"
    if fmt == "html":
        from halwatch.report.html import render

        text = render(summary, title)
        with replaced(output) as f:
            f.write(text)
        return summary
    from halwatch.report.markdown import render as render_md

    files = render_md(summary, title, output)
    for name, data in sorted(files.items(), key=lambda kv: kv[0] == output.name):  # the page last
        with replaced(output.parent / name, binary=True) as f:
            f.write(data)
    return summary
