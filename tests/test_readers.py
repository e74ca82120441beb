import gzip
import json
from collections import Counter

import pytest

from halwatch import InputError
from halwatch.data.jsonl import read_jsonl, write_jsonl
from halwatch.data.ragtruth import read_ragtruth
from halwatch.data.squad import read_squad


def test_ragtruth_join_and_filters():
    everything = read_ragtruth()
    assert len(everything) == 2967
    counts = Counter((s.meta["model"], s.meta["split"], s.label) for s in everything)
    assert counts[("llama-2-7b-chat", "test", 1)] == 52 and counts[("llama-2-7b-chat", "test", 0)] == 98
    assert counts[("mistral-7B-instruct", "train", 1)] == 347
    test = read_ragtruth(generator="llama-2-13b-chat", split="test")
    assert len(test) == 150 and {s.meta["model"] for s in test} == {"llama-2-13b-chat"}
    good = read_ragtruth(quality="good")
    assert len(good) == 2894
    for s in everything:
        start, end = s.context_span
        assert s.prompt[start:end].startswith("passage 1:")  # the passages, found inside the prompt
        assert s.prompt.startswith("Briefly answer the following question:")
        assert s.label == int(bool(s.spans))
    with pytest.raises(InputError, match="unknown RAGTruth generator"):
        read_ragtruth(generator="gpt-4")


def test_ragtruth_gold_spans_point_into_the_response():
    raw = {}
    with gzip.open(__import__("halwatch.data", fromlist=["data_root"]).data_root()
                   / "ragtruth" / "response.qa_open_models.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            raw[r["id"]] = r
    for s in read_ragtruth(generator="mistral-7B-instruct"):
        texts = [label["text"] for label in raw[s.id]["labels"]]
        assert [s.response[sp["start"] : sp["end"]] for sp in s.spans] == texts


def test_squad_reader():
    qs = read_squad()
    assert len(qs) == 6078
    assert sum(q.is_impossible for q in qs) == 3168
    assert all(q.answers for q in qs if not q.is_impossible)
    title = qs[0].title
    only = read_squad(titles=title)
    assert only and {q.title for q in only} == {title}
    sample = only[0].sample("an answer")
    assert sample.question in sample.prompt and sample.context in sample.prompt
    with pytest.raises(InputError, match="no article titled"):
        read_squad(titles="No Such Article")


def test_jsonl_roundtrip(tmp_path):
    samples = read_ragtruth(generator="llama-2-7b-chat", split="test")[:5]
    path = tmp_path / "x.jsonl"
    write_jsonl(path, (s.to_dict() for s in samples))
    back = read_jsonl(path)
    assert [(b.id, b.prompt, b.response, b.label, b.spans, b.context_span) for b in back] == [
        (s.id, s.prompt, s.response, s.label, s.spans, s.context_span) for s in samples
    ]
    assert back[0].meta["model"] == "llama-2-7b-chat"


GOOD = {"id": "a", "context": "The sky is blue.", "question": "What colour is the sky?", "response": "Blue."}
BAD_CASES = [
    (b'{"id": "x1", "prompt": "p"}', r"x\.jsonl:2 \(id=x1\): missing field 'response'"),
    (b'{"id": "x2", "response": "r"}', r"x\.jsonl:2 \(id=x2\): missing field 'prompt'"),
    (b'{"id": "x3", "prompt": "p", "response": "   "}', r"x\.jsonl:2 \(id=x3\): empty response"),
    (b'{"id": "x4", "prompt": "p", "response": "caf\xe9"}', r"x\.jsonl:2: not valid UTF-8 \(byte 0xe9"),
    (b'{"id": "x5", "prompt": "p", "response": "abc", "spans": [{"start": 1, "end": 9}]}',
     r"x\.jsonl:2 \(id=x5\): span \[1, 9\) is outside the response \(length 3\)"),
    (b'{"id": "x6", "prompt": "p", "response": "abc", "label": 2}', r"x\.jsonl:2 \(id=x6\): label must be 0, 1"),
    (b'{"id": "x7", "prompt": "p", "response": ', r"x\.jsonl:2: not valid JSON"),
    (b'["not", "an", "object"]', r"x\.jsonl:2: expected a JSON object"),
    (b'{"id": "x9", "prompt": "p", "response": 5}', r"x\.jsonl:2 \(id=x9\): field 'response' must be a string"),
]


@pytest.mark.parametrize("line,message", BAD_CASES)
def test_bad_records_are_named_and_can_be_skipped(tmp_path, line, message):
    path = tmp_path / "x.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + line + b"\n" + json.dumps({**GOOD, "id": "c"}).encode())
    with pytest.raises(InputError, match=message) as info:
        read_jsonl(path)
    assert "\n" not in str(info.value)
    skipped = []
    samples = read_jsonl(path, skip_invalid=True, on_skip=skipped.append)
    assert [s.id for s in samples] == ["a", "c"]
    assert len(skipped) == 1


def test_missing_id_defaults_to_line_number(tmp_path):
    path = tmp_path / "y.jsonl"
    path.write_text("\n" + json.dumps({k: v for k, v in GOOD.items() if k != "id"}) + "\n")
    assert read_jsonl(path)[0].id == "2"


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(InputError, match="cannot read"):
        read_jsonl(tmp_path / "nope.jsonl")
