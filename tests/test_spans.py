"""The span rule: spans snapped to words, gap bridging by hand, the vectorised span F1 used to choose the rule
against the benchmark's own character-level F1 on real RAGTruth answers, the choice itself on answers where the right
rule is known, and the spans' calibrated confidence."""

import numpy as np
import pytest

from halwatch import Sample
from halwatch.data.ragtruth import read_ragtruth
from halwatch.detectors.spans import (
    PLAIN,
    _char_table,
    _span_f1,
    fit_span_confidence,
    fit_span_rule,
    rule_spans,
    span_confidence,
)
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
        words = np.concatenate([v.word_scores(t) for v, t in zip(views, tokens)])
        assert _span_f1(words >= threshold, table, total, gap) == pytest.approx(reference, abs=1e-12)


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
    words = np.concatenate([v.word_scores(t) for v, t in zip(views, tokens)])
    plain_best = max(_span_f1(words >= t, *_char_table(views), 0) for t in (0.1, 0.5, 0.9))
    assert plain_best == pytest.approx(2 * 18 / (36 + 18))  # both answers flagged alike: precision 1/2
    threshold, rule, fit = fit_span_rule(tokens, views, np.array([0.8, 0.2]), decision=0.5)
    assert rule != PLAIN and (rule["gate"] or rule["verdict"])
    assert fit["f1"] == 1.0 and fit["by_gap"]["0"] == 1.0  # the made-up words alone: F1 1 with no gap needed
    spans = [rule_spans(views[k], tokens[k], p, 0.5, threshold, rule) for k, p in enumerate((0.8, 0.2))]
    assert [[s["text"] for s in x] for x in spans] == [["Napoleon Bonaparte"], []]
    assert fit["grounded_with_span"] == 0.0

    # the same answer probability too: only a rule that also flags the grounded answer finds the made-up words,
    # and it may not (at most one grounded answer in ten may get a span); unbounded, it is chosen
    same = np.array([0.8, 0.8])
    threshold, rule, fit = fit_span_rule(tokens, views, same, decision=0.5)
    assert [rule_spans(v, t, 0.8, 0.5, threshold, rule) for v, t in zip(views, tokens)] == [[], []]
    threshold, rule, fit = fit_span_rule(tokens, views, same, decision=0.5, max_grounded_share=None)
    assert fit["grounded_with_span"] == 1.0 and fit["f1"] == pytest.approx(2 / 3, abs=1e-4)


def test_a_span_covers_whole_words_whatever_tokens_score(smol):
    """One suspect piece of a word flags the whole word, and a span never starts or ends inside a word or on
    punctuation, whichever of its tokens score."""
    sample = Sample(prompt="p", response="It was designed by Xanthippus Quelltrammer, in 1925.")
    view = encode(sample, smol.tokenizer)
    pieces = [sample.response[a:b] for a, b in view.offsets]
    name = sample.response.index("Quelltrammer")
    inside = [i for i, (a, b) in enumerate(view.offsets) if a >= name and b <= name + len("Quelltrammer")]
    assert len(inside) >= 2, pieces  # the made-up name is several tokens
    scores = np.zeros(view.n_response)
    scores[inside[1]] = 0.9  # one piece inside the word
    scores[[i for i, p in enumerate(pieces) if p == "9" or p.strip() == "."]] = 0.8  # a digit of 1925, the stop
    spans = view.spans(scores, 0.5)
    assert [s["text"] for s in spans] == ["Quelltrammer", "1925"]
    assert spans[0]["confidence"] == 0.9


def test_a_span_confidence_is_given_to_four_places_calibrated_or_not(smol):
    """Token scores that differ below 5e-5 (a padded batch's float32 rounding against the answer alone) give equal
    spans: the confidence is rounded as the scores are, raw or calibrated."""
    response = "It was designed by Napoleon Bonaparte."
    view = encode(Sample(prompt="p", response=response), smol.tokenizer)
    alone = np.zeros(view.n_response)
    alone[[i for i, (a, b) in enumerate(view.offsets) if b > response.index("Napoleon")]] = 0.4992279537
    batched = np.where(alone > 0, 0.4992279618, 0.0)
    calibration, _ = fit_span_confidence([alone, alone * 1.8], [view, view], np.array([0.9, 0.9]), 0.5, 0.3,
                                         dict(PLAIN))
    for cal in (None, calibration):
        spans = [rule_spans(view, t, 0.9, 0.5, 0.3, dict(PLAIN), cal) for t in (alone, batched)]
        assert spans[0] == spans[1] and len(spans[0]) == 1
        assert spans[0][0]["confidence"] == round(spans[0][0]["confidence"], 4)
    assert spans[0][0]["text"] == "Napoleon Bonaparte"


def test_span_confidence_is_calibrated_on_the_probe_spans(smol):
    """On probe answers where spans of a higher raw score hit a human span more often, the fitted confidence rises
    with the raw score, and its mean over the probe's spans equals the share of them that hit (a logistic
    regression with an intercept matches the mean on its own training data)."""
    rng = np.random.default_rng(0)
    views, tokens, probs = [], [], []
    for k in range(80):
        response = "The tower was built by Napoleon Bonaparte in 1921."
        start = response.index("Napoleon")
        raw = rng.uniform(0.5, 1.0)
        hit = rng.random() < (raw - 0.5) * 2  # a span of raw score r hits with probability 2 r - 1
        sample = Sample(prompt="p", response=response,
                        spans=[{"start": start, "end": start + 18}] if hit else [])
        view = encode(sample, smol.tokenizer)
        t = np.zeros(view.n_response)
        t[[i for i, (a, b) in enumerate(view.offsets) if a >= start and b <= start + 18]] = raw
        views.append(view), tokens.append(t), probs.append(0.9)
    calibration, figures = fit_span_confidence(tokens, views, np.array(probs), 0.5, 0.5, dict(PLAIN))
    spans = [rule_spans(v, t, 0.9, 0.5, 0.5, dict(PLAIN), calibration) for v, t in zip(views, tokens)]
    assert figures["n_spans"] == 80 and all(len(s) == 1 for s in spans)
    confidences = np.array([s[0]["confidence"] for s in spans])
    hits = np.array([bool(v.sample.spans) for v in views])
    assert confidences.mean() == pytest.approx(hits.mean(), abs=0.01)
    low, high = span_confidence(calibration, [0.55, 0.95], [2, 2])
    assert low < 0.4 < 0.6 < high
    kept = [rule_spans(v, t, 0.9, 0.5, 0.5, dict(PLAIN), calibration, min_confidence=0.5)
            for v, t in zip(views, tokens)]
    assert all((len(k) == 1) == (c >= 0.5) for k, c in zip(kept, confidences))
