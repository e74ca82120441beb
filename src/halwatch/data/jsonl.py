"""The generic JSONL format that ``halwatch score`` and ``halwatch fit`` read, one JSON object per line:

``id`` (optional; defaults to the line number), ``prompt``, or ``context`` with an optional ``question`` and
``task`` (``qa``, ``summary``, ``dialogue``, ``data2text``: rendered with that task's template,
:data:`halwatch.sample.TEMPLATES`; by default ``qa`` with a question and ``summary`` without), ``response``, and
optionally ``label`` (1 = hallucinated, 0 = grounded),
``spans`` (``[{"start": int, "end": int, ...}]``, character offsets into ``response``), ``context_span``
(``[start, end]`` of the context inside ``prompt``) and ``meta`` (any object). Other fields go into ``meta``.
Files ending in ``.gz`` are read through gzip.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from halwatch.errors import InputError
from halwatch.files import replaced
from halwatch.sample import Sample, task_of

FIELDS = {"id", "prompt", "context", "question", "task", "response", "label", "spans", "context_span", "meta"}


#: Response of records read with ``prompts_only`` (answers still to be generated): a placeholder, never scored.
NO_RESPONSE = "(to be generated)"


def sample_from_record(record, where: str, prompts_only: bool = False, task: str | None = None) -> Sample:
    """One record as a sample; ``task`` applies where the record names none."""
    if not isinstance(record, dict):
        raise InputError(f"expected a JSON object, got {type(record).__name__}", where)
    rid = record.get("id")
    if rid is not None:
        where = f"{where} (id={rid})"
    if prompts_only:
        record = {**record, "response": NO_RESPONSE}
    if "response" not in record:
        raise InputError("missing field 'response'", where)
    for name in ("prompt", "context", "question", "response", "task"):
        if record.get(name) is not None and not isinstance(record[name], str):
            raise InputError(f"field '{name}' must be a string", where)
    from_context = record.get("context") is not None and not record.get("prompt")
    if not record.get("prompt") and not record.get("context"):
        raise InputError("missing field 'prompt' (or 'context', with 'question' where the task has one)", where)
    spans = record.get("spans") or []
    if not isinstance(spans, list) or not all(isinstance(s, dict) for s in spans):
        raise InputError("field 'spans' must be a list of objects with 'start' and 'end'", where)
    context_span = record.get("context_span")
    if context_span is not None and not (
        isinstance(context_span, list) and len(context_span) == 2 and all(isinstance(x, int) for x in context_span)
    ):
        raise InputError("field 'context_span' must be [start, end]", where)
    meta = dict(record.get("meta") or {})
    meta.update({k: v for k, v in record.items() if k not in FIELDS})
    try:
        return Sample(
            response=record["response"],
            prompt="" if from_context else record.get("prompt", ""),
            context=record.get("context"),
            question=record.get("question"),
            task=record.get("task") or task,
            id=rid,
            label=record.get("label"),
            spans=spans,
            context_span=tuple(context_span) if context_span else None,
            meta=meta,
        )
    except InputError as exc:
        raise InputError(exc.problem, where) from None


def sample_record(sample: Sample) -> dict:
    """A sample as a record of this format that reads back to the same prompt, context span, response and task (the
    prompt as it is, so the task is written out: a summary rendered from a context would read back as a QA prompt,
    judged by another part of a routed detector)."""
    record = {"id": sample.id, "prompt": sample.prompt, "response": sample.response, "task": task_of(sample)}
    if sample.context_span is not None:
        record["context_span"] = list(sample.context_span)
    return record


def json_lines(path: str | Path) -> list[tuple[int, bytes]]:
    """``(line number, bytes)`` of every non-blank line of a JSONL file (``.gz`` read compressed), or an
    :class:`InputError` naming the file it cannot read."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", str(path)) from None
    return [(lineno, raw) for lineno, raw in enumerate(lines, start=1) if raw.strip()]


def parse_line(raw: bytes, where: str):
    """The JSON value of one line, or an :class:`InputError` at ``where`` saying what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})", where) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"not valid JSON ({exc.msg} at column {exc.colno})", where) from None


def read_jsonl(path: str | Path, skip_invalid: bool = False, on_skip=None, prompts_only: bool = False,
               task: str | None = None) -> list[Sample]:
    """Read samples; a bad record raises :class:`InputError` naming ``file:line`` (and id), or with
    ``skip_invalid`` is reported through ``on_skip(error)`` and skipped. ``prompts_only``: records need no
    ``response`` (any is ignored; the samples carry :data:`NO_RESPONSE`), for generating answers. ``task``: the
    task of records that name none."""
    samples = []
    for lineno, raw in json_lines(path):
        where = f"{path}:{lineno}"
        try:
            record = parse_line(raw, where)
            if isinstance(record, dict) and record.get("id") is None:
                record["id"] = str(lineno)
            samples.append(sample_from_record(record, where, prompts_only, task))
        except InputError as exc:
            if not skip_invalid:
                raise
            if on_skip is not None:
                on_skip(exc)
    return samples


def write_jsonl(path: str | Path, records) -> None:
    """Write records (any iterable: they are written as they come) atomically: the file appears whole or not at
    all."""
    with replaced(path) as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
