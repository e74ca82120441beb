"""``halwatch bench report``: how long a report of many scored records takes to build, from real scored records
repeated (each copy a new id) up to the count asked for."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from halwatch.report.build import build
from halwatch.report.records import read_scored


def run_report_speed(scored: str, input_path: str | None = None, records: int = 10_000, repeats: int = 3,
                     by=(), out=print) -> dict:
    """Seconds to build the HTML and the Markdown report of ``records`` results: the first build of the process
    (with the imports of matplotlib and scikit-learn, as one ``halwatch report`` pays them) and the median of
    ``repeats`` more."""
    from halwatch.data.jsonl import read_jsonl, sample_record

    results = read_scored(scored)
    samples = {s.id: s for s in read_jsonl(input_path)} if input_path else {}
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with open(tmp / "scored.jsonl", "w", encoding="utf-8") as s_file, \
                open(tmp / "input.jsonl", "w", encoding="utf-8") as i_file:
            for k in range(records):
                r = results[k % len(results)]
                rid = f"{r.id}#{k // len(results)}"
                s_file.write(json.dumps({**r.to_dict(), "id": rid}, ensure_ascii=False) + "\n")
                if samples:
                    sample = samples[r.id]
                    i_file.write(json.dumps({**sample_record(sample), "id": rid, "label": sample.label,
                                             "meta": sample.meta}, ensure_ascii=False) + "\n")
        for fmt in ("html", "md"):
            times = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                build(tmp / "scored.jsonl", tmp / f"report.{fmt}", tmp / "input.jsonl" if samples else None, by)
                times.append(time.perf_counter() - t0)
            first, rest = times[0], sorted(times[1:])
            figures[fmt] = {"first": first, "median": rest[len(rest) // 2]}
            written = [tmp / f"report.{fmt}", *(tmp.glob("report-*.png") if fmt == "md" else ())]
            size = sum(p.stat().st_size for p in written)
            out(f"{records} scored records{' with their input' if samples else ''}: the {fmt} report in "
                f"{first:.2f} s the first time (imports included), then {figures[fmt]['median']:.2f} s (median of "
                f"{repeats}); {size / 1e6:.2f} MB written")
    return {"records": records, "seconds": figures}
