"""The records a report is made of: each line of a scored file (what ``halwatch score`` writes, one
:class:`halwatch.result.Result` per line), joined by id with the answer it judged where the original input is given
(its context, question, response, label and ``meta``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from halwatch.errors import InputError
from halwatch.result import Result
from halwatch.sample import Sample


@dataclass
class Scored:
    """One scored answer: its result and, with ``--input``, the sample it judged."""

    result: Result
    sample: Sample | None = None

    @property
    def label(self) -> int | None:
        return None if self.sample is None else self.sample.label

    def field(self, name: str) -> str:
        """The value of a ``--by`` field: a field of the result (``task``, ``detector``, ...) or a key of the
        sample's ``meta``; ``"-"`` where the answer has none."""
        value = getattr(self.result, name, None) if name in Result.model_fields else None
        if value is None and self.sample is not None:
            value = self.sample.meta.get(name)
        return "-" if value is None else str(value)


def read_scored(path: str | Path) -> list[Result]:
    """Every result of a scored JSONL file, or an :class:`InputError` naming the first line that is not one."""
    from pydantic import ValidationError

    from halwatch.data.jsonl import json_lines, parse_line

    results, seen = [], set()
    for lineno, raw in json_lines(path):
        where = f"{path}:{lineno}"
        record = parse_line(raw, where)
        if not isinstance(record, dict):
            raise InputError("not a scored result (a JSON object per line, as halwatch score writes)", where)
        if record.get("id") is not None:
            where = f"{where} (id={record['id']})"
        try:
            result = Result.model_validate(record)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(x) for x in first["loc"]) or "record"
            raise InputError(f"not a scored result of halwatch score: {field}: {first['msg']}", where) from None
        if result.id in seen:
            raise InputError(f"id {result.id!r} is scored twice", where)
        seen.add(result.id)
        results.append(result)
    if not results:
        raise InputError("no scored results in the file", str(path))
    return results


def joined(results: list[Result], input_path: str | Path | None) -> list[Scored]:
    """The results with the answers they judged (by id; an answer without an id in the input is its line number,
    as ``halwatch score`` names it), or an :class:`InputError` where a result's answer is not in the input or its
    spans are not that answer's words."""
    if input_path is None:
        return [Scored(r) for r in results]
    from halwatch.data.jsonl import read_jsonl

    samples = {s.id: s for s in read_jsonl(input_path)}
    out = []
    for r in results:
        sample = samples.get(r.id)
        if sample is None:
            raise InputError(f"no answer with this id in {input_path}: is it the file that was scored?",
                             f"id={r.id}")
        for span in r.spans:
            if sample.response[span.start:span.end] != span.text:
                raise InputError(f"span {span.start}-{span.end} {span.text!r} is not in the input's response: is "
                                 f"{input_path} the file that was scored?", f"id={r.id}")
        out.append(Scored(r, sample))
    return out
