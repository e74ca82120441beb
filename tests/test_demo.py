"""The README's demo on the real model and the shipped default: every made-up answer is flagged, with a span over a
made-up word, and scores above its grounded twin (same context, same question), which is not flagged and gets no
span, whatever its shape (question answering, or a summary without a question, judged by the summary part)."""

import json
from pathlib import Path

from halwatch.data.jsonl import read_jsonl
from halwatch.detectors import load_detector
from halwatch.scorer import Scorer

DEMO = Path(__file__).resolve().parents[1] / "src" / "halwatch" / "examples" / "demo.jsonl"
MADE_UP = {"eiffel": "Napoleon", "insulin": "red blood cells", "library-summary": "stadium"}


def test_demo_verdicts(smol):
    samples = read_jsonl(DEMO)
    assert {s.id.rsplit("-", 1)[0] for s in samples} == set(MADE_UP)
    scorer = Scorer(model=smol, cache=None)
    det = load_detector("default", scorer=scorer)
    views = [scorer.encode(s) for s in samples]
    results = dict(zip((s.id for s in samples), det.verdicts(views, scorer.signals(samples, det.request(),
                                                                                        views=views))))
    for pair, word in MADE_UP.items():
        made_up, grounded = results[f"{pair}-hallucinated"], results[f"{pair}-grounded"]
        assert made_up["hallucinated"] and made_up["score"] > grounded["score"], json.dumps([made_up, grounded])
        assert any(word in span["text"] for span in made_up["spans"]), json.dumps(made_up)
        assert not grounded["hallucinated"] and grounded["spans"] == [], json.dumps(grounded)
        assert made_up["task"] == grounded["task"] == ("summary" if pair.endswith("summary") else "qa")
