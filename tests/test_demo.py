"""The README's demo, pinned on the real model and the shipped default: every grounded answer below the threshold,
every made-up one above it, whatever its shape (question answering or a summary)."""

import json
from pathlib import Path

from halwatch.data.jsonl import read_jsonl
from halwatch.detectors import load_detector
from halwatch.scorer import Scorer

DEMO = Path(__file__).resolve().parents[1] / "src" / "halwatch" / "examples" / "demo.jsonl"


def test_demo_verdicts(smol):
    samples = read_jsonl(DEMO)
    assert {s.id.rsplit("-", 1)[1] for s in samples} == {"grounded", "hallucinated"}
    scorer = Scorer(model=smol, cache=None)
    det = load_detector("default", scorer=scorer)
    views = [scorer.encode(s) for s in samples]
    results = det.verdicts(views, scorer.signals(samples, det.request(), views=views))
    for sample, result in zip(samples, results):
        assert result["hallucinated"] == sample.id.endswith("hallucinated"), json.dumps(result)
        if result["hallucinated"]:
            assert result["spans"], sample.id
