import json

import pytest

from halwatch.data.generate import REFUSAL, generate_squad, label_answer, rouge_l
from halwatch.data.jsonl import read_jsonl
from halwatch.scorer import Scorer


def test_rouge_l_by_hand():
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    # LCS of "a b c d" and "a c e": "a c" -> P = 2/4, R = 2/3, F = 2PR/(P+R) = 4/7
    assert rouge_l("a b c d", "a c e") == pytest.approx(4 / 7)
    assert rouge_l("", "x") == 0.0 and rouge_l("x y", "z") == 0.0


@pytest.mark.parametrize("response,answers,impossible,label", [
    ("Denver Broncos", ["Denver Broncos"], False, 0),                       # ROUGE-L = 1
    ("The winner was the Denver Broncos team.", ["Denver Broncos"], False, 0),  # gold answer inside
    ("It was the Carolina Panthers.", ["Denver Broncos"], False, 1),         # ROUGE-L <= 0.3, no gold inside
    ("Denver won it", ["Denver Broncos"], False, None),                      # in between: dropped
    (REFUSAL + ".", [], True, 0),
    ("It was 1999.", [], True, 1),
])
def test_labelling_rule(response, answers, impossible, label):
    assert label_answer(response, answers, impossible)[0] == label


def test_generate_is_labelled_and_resumable(smol, tmp_path):
    scorer = Scorer(model=smol, input_mode="chat", cache=None)
    out = tmp_path / "squad.jsonl"
    first = generate_squad(scorer, out, n=2, seed=3, progress=False)
    assert first["answered"] == 2
    lines = out.read_text().splitlines() + (out.with_name(out.name + ".dropped.jsonl").read_text().splitlines())
    assert len(lines) == 2
    again = generate_squad(scorer, out, n=3, seed=3, progress=False)  # the first two are reused, one is new
    assert again["answered"] == 3 and again["kept"] + again["dropped"] == 3
    records = [json.loads(x) for x in out.read_text().splitlines()]
    for r in records:
        assert r["label"] in (0, 1) and r["response"] and "App. D.1" in r["meta"]["label_rule"]
        assert r["meta"]["dtype"] == smol.dtype == "float32"  # the precision the answers were generated in
        assert r["label"] == label_answer(r["response"], r["meta"]["answers"], r["meta"]["is_impossible"])[0]
    if records:
        assert len(read_jsonl(out)) == len(records)  # the output is generic JSONL
