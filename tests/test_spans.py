"""The span rule: gap bridging by hand, the vectorised span F1 used to choose the rule against the benchmark's own
character-level F1 on real RAGTruth answers, and the choice itself on answers where the right rule is known."""

import numpy as np
import pytest

from halwatch import Sample
from halwatch.data.ragtruth import read_ragtruth
from halwatch.detectors.spans import PLAIN, _char_table, _span_f1, fit_span_rule, rule_spans
from halwatch.eval.metrics import span_scores
from halwatch.tokens import encode


def test_runs_a_short_gap_apart_become_one_span(smol):
    sample = Sample(prompt="p", response="The tower was built by Napoleon Bonaparte in 1921.")
    view = encode(sample, smol.tokenizer)
    words = [sample.response[s:e].strip() for s, e in view.offsets]
    assert words[:8] == ["The", "tower", "was", "built", "by", "Napoleon", "Bonaparte", "in"]
    scores = np.array([1.0 if w in ("was", "Napoleon", "in") else 0.0 for w in words])
    assert [s["text"] for s in view.spans(scores, 0.5)] == ["was", "Napoleon", "in"]
    assert [s["text"] for s in view.spans(scores, 0.5, gap=1)] == ["was", "Napoleon Bonaparte in"]
    assert [s["text"] for s in view.spans(scores, 0.5, gap=2)] == ["was built by Napoleon Bonaparte in"]


def test_vectorised_span_f1_equals_the_benchmark_metric(smol):
    """The rule is chosen by a vectorised character F1; it must be the F1 that `eval.metrics.span_scores` gives
    the spans `TokenView.spans` builds, on real answers with white space, new lines and gold spans."""
    views = [encode(s, smol.tokenizer, max_tokens=1024)
             for s in read_ragtruth(generator="mistral-7B-instruct", split="test")[:60]]
    assert sum(bool(v.sample.spans) for v in views) >= 10
    table, total = _char_table(views)
    rng = np.random.default_rng(0)
    for _ in range(12):
        tokens = [rng.random(v.n_response) ** 3 for v in views]
        threshold, gap = rng.uniform(0.2, 0.9), int(rng.integers(0, 4))
        reference = span_scores([v.spans(t, threshold, gap) for v, t in zip(views, tokens)],
                                [v.sample.spans for v in views])["span_f1"]
        assert _span_f1(np.concatenate(tokens) >= threshold, table, total, gap) == pytest.approx(reference, abs=1e-12)


def test_the_rule_gates_by_the_answer_where_that_is_what_separates(smol):
    """Two answers with the same token scores: the one the detector believes hallucinated holds the made-up words,
    the one it believes grounded has none. No token threshold alone can tell them apart; gating by the answer's
    probability (or flagging only answers called hallucinated) can, and reaches F1 1."""
    made_up = "The tower was built by Napoleon Bonaparte in 1921."
    start = made_up.index("Napoleon")
    bad = Sample(prompt="p", response=made_up, spans=[{"start": start, "end": start + len("Napoleon Bonaparte")}])
    good = Sample(prompt="p", response=made_up, spans=[])
    views = [encode(bad, smol.tokenizer), encode(good, smol.tokenizer)]
    tokens = [np.where(views[0].token_labels() > 0, 0.9, 0.1)] * 2
    plain_best = max(_span_f1(np.concatenate(tokens) >= t, *_char_table(views), 0) for t in (0.1, 0.5, 0.9))
    assert plain_best == pytest.approx(2 * 18 / (36 + 18))  # both answers flagged alike: precision 1/2
    threshold, rule, fit = fit_span_rule(tokens, views, np.array([0.8, 0.2]), decision=0.5)
    assert rule != PLAIN and (rule["gate"] or rule["verdict"])
    assert fit["f1"] == 1.0 and fit["by_gap"]["0"] == 1.0  # the made-up words alone: F1 1 with no gap needed
    spans = [rule_spans(views[k], tokens[k], p, 0.5, threshold, rule) for k, p in enumerate((0.8, 0.2))]
    assert [[s["text"] for s in x] for x in spans] == [["Napoleon Bonaparte"], []]
