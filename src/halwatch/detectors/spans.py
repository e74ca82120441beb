"""How a detector's token scores become word spans with a calibrated confidence, and how that rule is chosen on
probe data.

A word's score is the highest score of its tokens (:meth:`halwatch.tokens.TokenView.word_scores`), so that spans start
and end on words. The plain rule flags every word whose score reaches the threshold and joins neighbouring flagged
words into one span (:meth:`halwatch.tokens.TokenView.spans`). Three further choices can be switched on:

- ``gap``: flagged runs that are at most ``gap`` words apart become one span (a made-up phrase often holds a function
  word that the token model scores low);
- ``gate``: each score is multiplied by the answer's probability of hallucination, so that a word in an answer the
  detector believes grounded needs a higher score to be flagged;
- ``verdict``: spans only in answers the detector calls hallucinated.

:func:`fit_span_rule` chooses the threshold and the three choices together on probe data with human spans, by the
figure the benchmark reports: the character-level F1 of the flagged spans against the human spans, pooled over the
answers (:func:`halwatch.eval.metrics.span_scores`). The token and answer scores it is given are the probe's
held-out scores for a supervised detector, so nothing of the test data and nothing the detector saw in training
enters the choice. :func:`fit_span_confidence` then maps a span's raw score and length to the probability that it
marks unsupported text (at least half of its characters inside a human span), by a logistic regression on the
probe's own spans under the chosen rule (Platt's method applied to spans). This is halwatch's own rule, not a
published method's: the papers threshold tokens (or Lookback Lens's windows) alone.

Rules fitted before spans were snapped to words (artifacts without ``"unit": "word"``) counted ``gap`` in tokens; a
word is about 1.3 tokens of the default model's tokenizer, so such a gap is read in words as it is, slightly wider.
"""

from __future__ import annotations

import itertools

import numpy as np

from halwatch.detectors import linear
from halwatch.detectors.logistic import sigmoid
from halwatch.tokens import TokenView, bridge_gaps

#: The plain rule: the threshold alone.
PLAIN = {"gap": 0, "gate": False, "verdict": False}
GAPS = (0, 1, 2, 3, 5, 8, 12)
#: Candidate thresholds: these quantiles of the (gated) word scores of the probe.
QUANTILES = np.linspace(0.5, 0.995, 40)
#: The largest share of the probe's grounded answers that a fitted rule may give a span: spans must not cry wolf.
#: Chosen on the dev split (issue 33): against the verdict's own rate (0.2) it kept 86 % of RAGTruth's grounded dev
#: answers free of spans instead of 68 %, with a higher span F1 (0.564 against 0.559).
MAX_GROUNDED_WITH_SPAN = 0.1
#: A wider gap must gain at least this much span F1 on the probe to be chosen over a narrower one: the F1 is flat
#: across gaps (within 0.006 for the default's token model), and a wide gap joins made-up words across the supported
#: ones between them ("1925 and was designed by Napoleon Bonaparte" instead of "1925" and "Napoleon Bonaparte").
GAP_TOLERANCE = 0.01
#: A span counts as right, for its confidence, when at least this share of its characters lies in a human span.
SPAN_HIT_SHARE = 0.5


def gated(scores: np.ndarray, prob: float, decision: float, rule: dict) -> np.ndarray | None:
    """The (token or word) scores the threshold is applied to under ``rule``, or ``None`` when the rule gives the
    answer no spans (``verdict`` and an answer probability below the decision threshold)."""
    if rule.get("verdict") and prob < decision:
        return None
    scores = np.asarray(scores, dtype=float)
    return scores * prob if rule.get("gate") else scores


def rule_spans(view: TokenView, tokens, prob: float, decision: float, threshold: float, rule: dict,
               calibration: dict | None = None, min_confidence: float = 0.0) -> list[dict]:
    """The word spans of one response under ``rule`` at ``threshold`` (``prob``: the response's probability of
    hallucination; ``decision``: the detector's decision threshold). With ``calibration``
    (:func:`fit_span_confidence`) each span's ``confidence`` is its calibrated probability, and spans below
    ``min_confidence`` are dropped. Confidences are rounded to 4 places, as scores are: the float32 rounding of a
    batch (a GRU over padded answers) must not make a span's confidence differ from that of its answer scored
    alone."""
    scores = gated(tokens, prob, decision, rule)
    if scores is None:
        return []
    spans = view.spans(scores, threshold, rule["gap"])
    for span in spans:
        confidence = span["confidence"]
        if calibration is not None:
            n_words = max(1, view.word_count(span["start"], span["end"]))
            confidence = span_confidence(calibration, confidence, n_words)[0]
        span["confidence"] = round(float(confidence), 4)
    return [span for span in spans if span["confidence"] >= min_confidence]


def _confidence_inputs(raw, n_words) -> np.ndarray:
    return np.stack([np.asarray(raw, dtype=float), np.log(np.asarray(n_words, dtype=float))], axis=1)


def span_confidence(calibration: dict, raw, n_words) -> np.ndarray:
    """The calibrated probability that a span with highest word score ``raw`` and ``n_words`` words marks
    unsupported text."""
    x = _confidence_inputs(np.atleast_1d(raw), np.atleast_1d(n_words))
    return sigmoid(linear.logodds(calibration, x))


def fit_span_confidence(tokens: list, views: list, probs, decision: float, threshold: float,
                        rule: dict) -> tuple[dict | None, dict]:
    """``(calibration, figures)``: a logistic regression from each probe span's raw score and log word count to
    whether at least :data:`SPAN_HIT_SHARE` of its characters lie in a human span, fitted on every span the chosen
    rule gives on the probe's held-out scores; ``None`` when the probe gives spans of one outcome only. The figures:
    the number of spans and the share that hit."""
    raw, n_words, hit = [], [], []
    for t, view, p in zip(tokens, views, probs):
        gold = np.zeros(len(view.sample.response) + 1, dtype=np.int64)
        for g in view.sample.spans:
            gold[g["start"]:g["end"]] = 1
        inside = np.r_[0, np.cumsum(gold)]
        for span in rule_spans(view, t, float(p), decision, threshold, rule):
            raw.append(span["confidence"])
            n_words.append(max(1, view.word_count(span["start"], span["end"])))
            hit.append((inside[span["end"]] - inside[span["start"]]) >= SPAN_HIT_SHARE * (span["end"] - span["start"]))
    hit = np.asarray(hit, dtype=int)
    figures = {"n_spans": int(len(hit)), "hit_share": round(float(hit.mean()), 4) if len(hit) else None}
    if len(np.unique(hit)) < 2:
        return None, figures
    return linear.fit(_confidence_inputs(raw, n_words), hit, C=1.0), figures


def _char_table(views) -> tuple[dict, int]:
    """Per word of every view (concatenated): where it starts (``a``) and ends (``b``), the number of gold
    characters of its response before ``a`` and before ``b``, and the owner; with the total number of gold
    characters. A span from word ``i`` to word ``j`` covers ``a[i] .. b[j]``."""
    a, b, ga, gb, owner = [], [], [], [], []
    total = 0
    for k, view in enumerate(views):
        text = view.sample.response
        gold = np.zeros(len(text), dtype=bool)
        for span in view.sample.spans:
            gold[span["start"]:span["end"]] = True
        before = np.r_[0, np.cumsum(gold)]
        total += int(before[-1])
        starts, ends, _, _ = view.word_index()
        a.append(starts)
        b.append(ends)
        ga.append(before[starts])
        gb.append(before[ends])
        owner.append(np.full(len(starts), k))
    table = {name: np.concatenate(v).astype(np.int64) if v else np.zeros(0, np.int64) for name, v in
             (("a", a), ("b", b), ("ga", ga), ("gb", gb), ("owner", owner))}
    return table, total


def _span_f1(flags: np.ndarray, table: dict, total_gold: int, gap: int) -> float:
    """Character F1 of the spans that ``flags`` (one per word, concatenated) give with ``gap``, as
    :func:`halwatch.eval.metrics.span_scores` counts it."""
    owner = table["owner"]
    idx = np.arange(len(flags))
    flags = bridge_gaps(flags, gap, owner)
    new_answer = np.r_[True, owner[1:] != owner[:-1]]
    last_of_answer = np.r_[owner[1:] != owner[:-1], True]
    starts = flags & (new_answer | ~np.r_[False, flags[:-1]])
    ends = flags & (last_of_answer | ~np.r_[flags[1:], False])
    first, last = idx[starts], idx[ends]
    predicted = np.maximum(table["b"][last] - table["a"][first], 0).sum()
    hit = np.maximum(table["gb"][last] - table["ga"][first], 0).sum()
    return float(2 * hit / (predicted + total_gold)) if predicted + total_gold else 0.0


def fit_span_rule(tokens: list, views: list, probs: np.ndarray, decision: float,
                  max_grounded_share: float | None = MAX_GROUNDED_WITH_SPAN) -> tuple[float, dict, dict]:
    """``(threshold, rule, fit)`` with the highest character-level span F1 on the probe: every rule of :data:`GAPS` x
    gate x verdict, each with thresholds at :data:`QUANTILES` of its word scores; the narrowest gap within
    :data:`GAP_TOLERANCE` of the best F1 wins, and ties keep the earlier, plainer rule. With ``max_grounded_share``,
    a rule that puts a span in more than that share of the probe's grounded answers is not a candidate (``None``:
    any rule; where none qualifies, a threshold above every probe score). ``fit`` reports the probe figures: the
    chosen rule's F1 (``f1``), the share of grounded answers it gives a span (``grounded_with_span``) and the best
    F1 reached with each gap (``by_gap``), so that a user sees how flat the choice was and whether it sits at the
    grid's edge."""
    table, total_gold = _char_table(views)
    words_of = [view.word_scores(t) for view, t in zip(views, tokens)]
    grounded = np.array([not view.sample.spans and view.sample.label != 1 for view in views])
    starts = np.cumsum([0] + [len(w) for w in words_of])[:-1]
    has_words = np.array([len(w) > 0 for w in words_of])
    found = {gap: (-1.0, np.inf, PLAIN, 0.0) for gap in GAPS}  # per gap: (F1, threshold, rule, grounded share)
    for verdict, gate in itertools.product((False, True), (False, True)):
        rule = {"gap": 0, "gate": gate, "verdict": verdict}
        scores = [gated(w, p, decision, rule) for w, p in zip(words_of, probs)]
        values = np.concatenate([s if s is not None else np.full(len(w), -np.inf) for s, w in zip(scores, words_of)])
        finite = values[np.isfinite(values)]
        if not len(finite):
            continue
        top = np.full(len(views), -np.inf)  # each answer's highest word score: it has a span when that passes
        top[has_words] = np.maximum.reduceat(values, starts[has_words]) if len(values) else -np.inf
        for threshold in np.unique(np.quantile(finite, QUANTILES)):
            noisy = float((top[grounded] >= threshold).mean()) if grounded.any() else 0.0
            if max_grounded_share is not None and noisy > max_grounded_share:
                continue
            flags = values >= threshold
            for gap in GAPS:
                f1 = _span_f1(flags, table, total_gold, gap)
                if f1 > found[gap][0]:
                    found[gap] = (f1, float(threshold), {**rule, "gap": gap, "unit": "word"}, noisy)
    top_f1 = max(f for f, *_ in found.values())
    best = next(found[gap] for gap in GAPS if found[gap][0] >= top_f1 - GAP_TOLERANCE)
    by_gap = {gap: max(found[gap][0], 0.0) for gap in GAPS}
    if best[0] < 0:  # no rule keeps the grounded answers clean enough: flag nothing the probe saw
        best = (0.0, float(max(np.max(w) if len(w) else -np.inf for w in words_of)) + 1e-9,
                {**PLAIN, "unit": "word"}, 0.0)
    fit = {"f1": round(max(best[0], 0.0), 4), "grounded_with_span": round(best[3], 4),
           "by_gap": {str(g): round(f, 4) for g, f in by_gap.items()}}
    return best[1], best[2], fit


def describe_rule(rule: dict) -> str:
    """One line for people: ``gap 8, gated, verdict only``."""
    return ", ".join([f"gap {rule['gap']}"] + (["gated"] if rule.get("gate") else [])
                     + (["verdict only"] if rule.get("verdict") else []))


def check_confidence(value) -> float:
    """A minimum span confidence: a number in [0, 1], or an :class:`InputError` saying so."""
    from halwatch.errors import InputError

    try:
        value = float(value)
    except (TypeError, ValueError):
        raise InputError(f"min_span_confidence must be a number in [0, 1], not {value!r}") from None
    if not 0.0 <= value <= 1.0:
        raise InputError(f"min_span_confidence must be in [0, 1], not {value:g}")
    return value


class SpanRule:
    """The part of a detector that turns its token scores into word spans: the token ``threshold``, the ``rule``
    (``gap``, ``gate``, ``verdict``: the module docstring), the spans' confidence ``calibration`` and the
    ``min_confidence`` below which spans are left out. Artifact section: ``token_threshold``, ``span_rule``,
    ``span_calibration``, ``min_span_confidence``. Unfitted (no threshold), it gives no spans."""

    def __init__(self):
        self.threshold: float | None = None
        self.rule: dict = dict(PLAIN)
        self.calibration: dict | None = None
        self.min_confidence = 0.0

    def fit(self, tokens: list, probs: np.ndarray, labels, views: list | None, decision: float) -> dict | None:
        """Fit on the probe's (held-out) token scores and probabilities, ``decision`` the answer threshold: where
        the probe has gold spans (``views`` given), the rule with the best character span F1 (:func:`fit_span_rule`)
        and the spans' confidence (:func:`fit_span_confidence`), returning the probe figures; otherwise the plain
        rule at the 95th percentile of token scores in grounded probe responses (a token is flagged when it is
        rarer than that in grounded answers), returning ``None``."""
        if views is not None:
            keep = [i for i, v in enumerate(views) if v.has_token_labels]  # not answers flagged without spans
            tokens, views, probs = [tokens[i] for i in keep], [views[i] for i in keep], probs[keep]
            self.threshold, self.rule, fit = fit_span_rule(tokens, views, probs, decision)
            self.calibration, fit["confidence"] = fit_span_confidence(tokens, views, probs, decision,
                                                                      self.threshold, self.rule)
            return fit
        grounded = [t for t, label in zip(tokens, labels) if label == 0]
        self.threshold, self.rule = float(np.quantile(np.concatenate(grounded), 0.95)), dict(PLAIN)
        return None

    def spans(self, view: TokenView, tokens, prob: float, decision: float, min_confidence: float | None = None
              ) -> list[dict]:
        """The flagged word spans of one response (``tokens``: its token scores, ``None`` for a method without
        them), ``prob`` its probability and ``decision`` the threshold, both on the scale the rule was fitted on;
        spans below ``min_confidence`` (default :attr:`min_confidence`) left out."""
        if tokens is None or self.threshold is None:
            return []
        floor = self.min_confidence if min_confidence is None else min_confidence
        return rule_spans(view, tokens, prob, decision, self.threshold, self.rule, self.calibration, floor)

    def sentence_chances(self, view: TokenView, tokens, prob: float, decision: float,
                         ranges: list[tuple[int, int]]) -> list[float]:
        """Each sentence's (``ranges``: character ranges of the response) chance of holding unsupported words:
        :func:`span_confidence` of its highest word score (gated as the rule gates) and its word count, as if the
        whole sentence were one span; no higher than ``prob`` where the rule gives spans only to answers judged
        hallucinated and this one is not. Without token scores or a span calibration, the answer's ``prob``.
        halwatch's own rule (issue 76), not a published method's."""
        if tokens is None or self.threshold is None or self.calibration is None:
            return [prob] * len(ranges)
        scores = gated(tokens, prob, decision, {**self.rule, "verdict": False})
        words = view.word_scores(scores)
        starts = view.word_index()[0]
        out = []
        for start, end in ranges:
            inside = words[np.searchsorted(starts, start):np.searchsorted(starts, end)]
            if not len(inside):
                out.append(prob)
                continue
            chance = float(span_confidence(self.calibration, inside.max(), len(inside))[0])
            out.append(min(chance, prob) if self.rule.get("verdict") and prob < decision else chance)
        return out

    def to_dict(self) -> dict:
        return {"token_threshold": self.threshold, "span_rule": self.rule, "span_calibration": self.calibration,
                "min_span_confidence": self.min_confidence}

    @classmethod
    def from_dict(cls, d: dict) -> "SpanRule":
        part = cls()
        part.threshold = d.get("token_threshold")
        part.rule = {**PLAIN, **d.get("span_rule", {})}  # artifacts from before the rule: the plain one
        part.calibration = d.get("span_calibration")
        part.min_confidence = check_confidence(d.get("min_span_confidence", 0.0))
        return part
