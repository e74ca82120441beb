"""How a detector's token scores become character spans, and how that rule is chosen on probe data.

The plain rule flags every response token whose score reaches the token threshold and joins neighbouring flagged
tokens into one span (:meth:`halwatch.tokens.TokenView.spans`). Three further choices can be switched on:

- ``gap``: flagged runs that are at most ``gap`` tokens apart become one span (a made-up phrase often holds a
  function word that the token model scores low);
- ``gate``: each token score is multiplied by the answer's probability of hallucination, so that a token in an
  answer the detector believes grounded needs a higher score to be flagged;
- ``verdict``: spans only in answers the detector calls hallucinated.

:func:`fit_span_rule` chooses the threshold and the three choices together on probe data with human spans, by the
figure the benchmark reports: the character-level F1 of the flagged spans against the human spans, pooled over the
answers (:func:`halwatch.eval.metrics.span_scores`). The token and answer scores it is given are the probe's
held-out scores for a supervised detector, so nothing of the test data and nothing the detector saw in training
enters the choice. This is halwatch's own rule, not a published method's: the papers threshold tokens (or Lookback
Lens's windows) alone.
"""

from __future__ import annotations

import itertools

import numpy as np

from halwatch.tokens import TokenView, bridge_gaps

#: The plain rule: the token threshold alone.
PLAIN = {"gap": 0, "gate": False, "verdict": False}
GAPS = (0, 1, 2, 3, 5, 8, 12, 16)
#: Candidate thresholds: these quantiles of the (gated) token scores of the probe.
QUANTILES = np.linspace(0.5, 0.995, 40)


def gated(tokens: np.ndarray, prob: float, decision: float, rule: dict) -> np.ndarray | None:
    """The token scores the threshold is applied to under ``rule``, or ``None`` when the rule gives the answer no
    spans (``verdict`` and an answer probability below the decision threshold)."""
    if rule.get("verdict") and prob < decision:
        return None
    tokens = np.asarray(tokens, dtype=float)
    return tokens * prob if rule.get("gate") else tokens


def rule_spans(view: TokenView, tokens, prob: float, decision: float, threshold: float, rule: dict) -> list[dict]:
    """The character spans of one response under ``rule`` at token ``threshold`` (``prob``: the response's
    probability of hallucination; ``decision``: the detector's decision threshold)."""
    scores = gated(tokens, prob, decision, rule)
    return [] if scores is None else view.spans(scores, threshold, rule["gap"])


def _char_table(views) -> tuple[dict, int]:
    """Per response token of every view (concatenated): where a span that starts at the token begins and where
    one that ends at it ends (``a``: the first character at or after its start that is not white space; ``b``: one
    past the last such character before its end; :meth:`TokenView.spans` trims a span's edges so), the number of
    gold characters before ``a`` and before ``b`` in its response, and the owner; with the total number of gold
    characters."""
    a, b, ga, gb, owner = [], [], [], [], []
    total = 0
    for k, view in enumerate(views):
        text = view.sample.response
        gold = np.zeros(len(text), dtype=bool)
        for span in view.sample.spans:
            gold[span["start"]:span["end"]] = True
        before = np.r_[0, np.cumsum(gold)]
        total += int(before[-1])
        solid = np.r_[np.flatnonzero([not c.isspace() for c in text]), len(text)]  # and a sentinel at the end
        offsets = np.asarray(view.offsets, dtype=np.int64).reshape(-1, 2)
        lo = solid[np.searchsorted(solid, offsets[:, 0])]  # the first solid character at or after the start
        last = np.searchsorted(solid[:-1], offsets[:, 1]) - 1  # the last solid character before the end
        hi = np.where(last >= 0, solid[np.maximum(last, 0)] + 1, 0)
        a.append(lo)
        b.append(hi)
        ga.append(before[lo])
        gb.append(before[hi])
        owner.append(np.full(len(offsets), k))
    table = {name: np.concatenate(v).astype(np.int64) if v else np.zeros(0, np.int64) for name, v in
             (("a", a), ("b", b), ("ga", ga), ("gb", gb), ("owner", owner))}
    return table, total


def _span_f1(flags: np.ndarray, table: dict, total_gold: int, gap: int) -> float:
    """Character F1 of the spans that ``flags`` (one per token, concatenated) give with ``gap``, as
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


def fit_span_rule(tokens: list, views: list, probs: np.ndarray, decision: float) -> tuple[float, dict, dict]:
    """``(threshold, rule, fit)`` with the highest character-level span F1 on the probe: every rule of :data:`GAPS` x
    gate x verdict, each with thresholds at :data:`QUANTILES` of its token scores. Ties keep the earlier, plainer
    rule. ``fit`` reports the probe figures: the chosen rule's F1 (``f1``) and the best F1 reached with each gap
    (``by_gap``), so that a user sees how flat the choice was and whether it sits at the grid's edge."""
    table, total_gold = _char_table(views)
    best = (-1.0, 0.5, PLAIN)
    by_gap = {gap: 0.0 for gap in GAPS}
    for verdict, gate in itertools.product((False, True), (False, True)):
        rule = {"gap": 0, "gate": gate, "verdict": verdict}
        scores = [gated(t, p, decision, rule) for t, p in zip(tokens, probs)]
        values = np.concatenate([s if s is not None else np.full(len(t), -np.inf) for s, t in zip(scores, tokens)])
        finite = values[np.isfinite(values)]
        if not len(finite):
            continue
        for threshold in np.unique(np.quantile(finite, QUANTILES)):
            flags = values >= threshold
            for gap in GAPS:
                f1 = _span_f1(flags, table, total_gold, gap)
                by_gap[gap] = max(by_gap[gap], f1)
                if f1 > best[0]:
                    best = (f1, float(threshold), {**rule, "gap": gap})
    fit = {"f1": round(max(best[0], 0.0), 4), "by_gap": {str(g): round(f, 4) for g, f in by_gap.items()}}
    return best[1], best[2], fit


def describe_rule(rule: dict) -> str:
    """One line for people: ``gap 8, gated, verdict only``."""
    return ", ".join([f"gap {rule['gap']}"] + (["gated"] if rule.get("gate") else [])
                     + (["verdict only"] if rule.get("verdict") else []))
