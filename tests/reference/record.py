"""Record what `halwatch score` and `halwatch serve` return for the README demo and 50 RAGTruth test answers, so that
tests/test_reference.py can check that a change of the code's shape changes none of it.

    HALWATCH_DTYPE=float32 .venv/bin/python tests/reference/record.py

writes tests/reference/verdicts.json: the answers (the demo's records whole, RAGTruth's by id), each answer's line of
`halwatch score --input F --output -` and its result from `POST /v1/score` (one request of all answers, the shipped
default, a server on a loopback port). Recorded at 8335ab3 (before the one scoring path of issue 74), in float32
on a 2-core Xeon with AVX-512; recorded again at 2757e60, the default refitted in bfloat16 (issue 75), with the code
unchanged since c165f0a, where the recording of 8335ab3 still held (CI): scored again in float32, as the tests pin.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEMO = ROOT / "src" / "halwatch" / "examples" / "demo.jsonl"
N_RAGTRUTH = 50


def ragtruth_ids() -> list[str]:
    """50 answers of RAGTruth's official test split (every generator), drawn with seed 0, in file order."""
    from halwatch.data.ragtruth import read_ragtruth

    test = read_ragtruth(split="test")
    return sorted(random.Random(0).sample([s.id for s in test], N_RAGTRUTH), key=[s.id for s in test].index)


def records() -> list[dict]:
    """The answers as records of the generic JSONL format: the demo's, then the RAGTruth answers'."""
    from halwatch.data.jsonl import sample_record
    from halwatch.data.ragtruth import read_ragtruth

    demo = [json.loads(line) for line in DEMO.read_text(encoding="utf-8").splitlines() if line.strip()]
    by_id = {s.id: s for s in read_ragtruth(split="test")}
    rag = []
    for rid in ragtruth_ids():
        record = sample_record(by_id[rid])
        rag.append({k: record[k] for k in ("id", "prompt", "response", "task")})
    return demo + rag


def serve_all(items: list[dict], models: dict | None = None) -> list:
    """What `POST /v1/score` returns for all ``items`` in one request, from the shipped default on a server started
    on a loopback port for it (and stopped): an hour's limit, so that the service's time estimate does not refuse the
    request on a slow or busy machine. ``models`` hands the server models already loaded."""
    import httpx2 as httpx

    from halwatch.serve.common import Running
    from halwatch.serve.scoring import Limits, build_app

    limits = Limits(max_items=len(items), timeout=3600, queue_tokens=1 << 24)
    running = Running(build_app(["default"], models=models, limits=limits))
    try:
        return httpx.post(running.url + "/v1/score", json=items, timeout=3600).json()
    finally:
        running.stop()


def main() -> None:
    assert os.environ.get("HALWATCH_DTYPE") == "float32", "record in float32 (HALWATCH_DTYPE=float32)"
    items = records()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "in.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in items), encoding="utf-8")
        out = subprocess.run([sys.executable, "-m", "halwatch", "score", "--input", str(path), "--output", "-",
                              "--no-cache"], check=True, capture_output=True, text=True).stdout
    command = [json.loads(line) for line in out.splitlines()]
    served = serve_all(items)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    (HERE / "verdicts.json").write_text(json.dumps({
        "recorded_at": commit, "dtype": "float32",
        "demo": [r["id"] for r in items[:6]], "ragtruth_test": ragtruth_ids(),
        "command": command, "served": served}, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"{len(command)} command lines, {len(served)} served results -> {HERE / 'verdicts.json'}")


if __name__ == "__main__":
    main()
