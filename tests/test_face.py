"""The one face, `halwatch.load().check(...)`, on the real default model: it returns what `halwatch score` returned
for the README demo (tests/reference, recorded before the face existed), batched, windowed and one-by-one results
are equal, threads may share a checker, and bad input raises the typed one-line errors the command gives."""

import json
import threading
from pathlib import Path

import pytest

import halwatch
from halwatch.errors import HalwatchError, InputError, ModelError
from halwatch.result import Result

RECORDED = json.loads((Path(__file__).resolve().parent / "reference" / "verdicts.json").read_text(encoding="utf-8"))
DEMO = Path(__file__).resolve().parents[1] / "src" / "halwatch" / "examples" / "demo.jsonl"
EIFFEL = {"context": "The Eiffel Tower in Paris was completed in 1889 and was designed by the company of Gustave "
                     "Eiffel.",
          "question": "When was the Eiffel Tower completed and who designed it?",
          "response": "The Eiffel Tower was completed in 1925 and was designed by Napoleon Bonaparte."}


@pytest.fixture(scope="module")
def demo():
    return [json.loads(line) for line in DEMO.read_text(encoding="utf-8").splitlines() if line.strip()]


def plain(result: Result) -> dict:
    """A result's fields that must not depend on how it was computed, numbers to 1e-4."""
    d = result.to_dict()
    return {**d, "score": pytest.approx(d["score"], abs=1e-4),
            "spans": [{**s, "confidence": pytest.approx(s["confidence"], abs=1e-4)} for s in d["spans"]]}


def test_the_face_returns_what_the_command_returned(hw, demo):
    results = hw.check_many(demo)
    recorded = {r["id"]: r for r in RECORDED["command"]}
    for result in results:
        assert isinstance(result, Result)
        got = result.to_dict()
        assert got["offset_unit"] == "unicode_code_point"  # in the recording since 2757e60
        expected = recorded[got["id"]]
        assert set(got) == set(expected)
        assert {k: v for k, v in got.items() if k not in ("score", "spans", "ood")} == {
            k: v for k, v in expected.items() if k not in ("score", "spans", "ood")}
        assert got["score"] == pytest.approx(expected["score"], abs=2e-4)
        assert [(s["start"], s["end"], s["text"]) for s in got["spans"]] == [
            (s["start"], s["end"], s["text"]) for s in expected["spans"]]
    eiffel = hw.check(**EIFFEL)  # the README's one-answer example
    assert eiffel.hallucinated and [s.text for s in eiffel.spans] == ["1925", "Napoleon Bonaparte"]
    assert eiffel.id == "0" and eiffel.task == "qa" and eiffel.detector == "routed"
    assert eiffel.scoring_model == hw.scoring_model == "smollm2-135m"


def test_batched_windowed_and_one_by_one_results_are_equal(smol, demo, probe_by_size):
    """Answers whose RAGTruth contexts a 256-token cap cuts into windows, beside the demo's: one call in batches
    of the token budget, one call one answer per pass, and one call per answer give the same results."""
    hw = halwatch.load(model=smol, max_tokens=256)
    long = [s for s in probe_by_size if len(s.response) < 300][:3]
    records = demo[:2] + [{"id": s.id, "prompt": s.prompt, "response": s.response} for s in long]
    batched = hw.check_many(records, batch_size=None)
    single_pass = hw.check_many(records, batch_size=1)
    one_by_one = [hw.check(**r) for r in records]
    assert max(r.windows for r in batched) > 1
    for a, b, c in zip(batched, single_pass, one_by_one):
        assert plain(b) == plain(a) and plain(c) == plain(a)


def test_threads_share_a_checker(hw, demo):
    alone = [hw.check(**r) for r in demo]
    found = [None] * len(demo)
    errors = []

    def one(i):
        try:
            found[i] = hw.check(**demo[i])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(demo))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [plain(r) for r in found] == [plain(r) for r in alone]


@pytest.mark.parametrize("record, words", [
    ({"context": "Paris is in France.", "question": "Where is Paris?", "response": "   "}, "empty response"),
    ({"context": "Paris is in France.", "question": "Where is Paris?"}, "missing field 'response'"),
    ({"context": "Paris is in France.", "response": "In France.", "task": "poem"}, "unknown task 'poem'"),
    ({"context": [], "response": "In France."}, "a non-empty list of strings"),
    ({"response": "In France."}, "missing field 'prompt'"),
    ({"context": "Paris.", "question": "Where?", "response": "word " * 2000}, "over the cap"),
])
def test_bad_input_raises_one_typed_line(hw, record, words):
    with pytest.raises(InputError, match=words) as caught:
        hw.check_many([record])
    assert "\n" not in str(caught.value) and str(caught.value).startswith(("record 0 (id=0): ", "id=0: "))


def test_bad_names_fail_when_loaded():
    with pytest.raises(HalwatchError, match="no artifact file 'nope.json'"):
        halwatch.load("nope.json")
    with pytest.raises(ModelError):
        halwatch.load(model="/nonexistent/model-folder")
    with pytest.raises(InputError, match="min_span_confidence must be in"):
        halwatch.load(min_span_confidence=2)
