"""What users get does not move when the code's shape does: `halwatch score` and `halwatch serve` on the README demo
and 50 RAGTruth test answers return what they returned when tests/reference/record.py recorded them (at 8335ab3,
before the one scoring path; again at 2757e60 for the refitted default, the code unchanged), field for field.

The recording is float32 on one machine; another CPU's float32 kernels may round the last bit of a sum differently,
so the probabilities and confidences (rounded to 4 decimals) may differ by one unit in the last place: they are
compared to 2e-4, every other field (verdict, threshold, span offsets and text, task, windows, ...) exactly."""

import json
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent / "reference"
RECORDED = json.loads((HERE / "verdicts.json").read_text(encoding="utf-8"))


def recorder():
    """tests/reference/record.py as a module: the answers it recorded and the request it sent."""
    import sys

    sys.path.insert(0, str(HERE))
    try:
        import record
    finally:
        sys.path.remove(str(HERE))
    return record


@pytest.fixture(scope="module")
def items():
    found = recorder().records()
    assert [r["id"] for r in found] == [r["id"] for r in RECORDED["command"]]
    return found


def same(got: dict, expected: dict) -> None:
    """``got`` carries every field of ``expected`` with the same value (numbers of 4 decimals to 2e-4)."""
    def close(a, b, where):
        if isinstance(b, float) and not isinstance(b, bool):
            assert a == pytest.approx(b, abs=2e-4), where
        elif isinstance(b, dict):
            assert isinstance(a, dict) and set(a) >= set(b), where
            for k in b:
                close(a[k], b[k], f"{where}.{k}")
        elif isinstance(b, list):
            assert isinstance(a, list) and len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b)):
                close(x, y, f"{where}[{i}]")
        else:
            assert a == b, f"{where}: {a!r} != {b!r}"

    close(got, expected, expected["id"])


def test_the_command_returns_what_it_returned(items, tmp_path, halwatch):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in items), encoding="utf-8")
    out = halwatch("score", "--input", path, "--output", "-").stdout
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == len(RECORDED["command"])
    for got, expected in zip(lines, RECORDED["command"]):
        same(got, expected)
    assert sum(r["hallucinated"] for r in lines) == sum(r["hallucinated"] for r in RECORDED["command"]) > 10


def test_the_service_returns_what_it_returned(items, smol):
    served = recorder().serve_all(items, models={"smollm2-135m": smol})  # one request of all 56, as recorded
    assert len(served) == len(RECORDED["served"])
    for got, expected in zip(served, RECORDED["served"]):
        same(got, expected)
        assert set(got) == set(expected)  # the response's fields are the recorded ones, no more
