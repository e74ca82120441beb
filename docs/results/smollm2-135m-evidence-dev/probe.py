"""Issue 76, a feasibility probe on the dev split (nothing shipped): can the attention that the one pass already
computes point at the context sentence an answer rests on?

On grounded SQuAD-built answers of the dev split (squad-shapes: `phrase`, the gold answer alone, and `sentence`,
the gold sentence copied), each answer's evidence sentence is the context sentence (cut as
halwatch.data.shapes.sentence_around cuts) that gets the most attention mass from the response tokens, summed over
a set of heads and the response tokens, divided by the sentence's token count or not; it is right when it is the
sentence that holds SQuAD's gold answer. Head sets: every head, the last third of the layers, and the heads whose
attention from the response lands most on the context (the top 10 % by mean lookback ratio, no label or gold
sentence used: chosen on these answers, which makes that row optimistic, and chosen on as many grounded answers of
the train split, which does not). Against it, the lexical baseline: the sentence with
the most words of the answer (lower-case word overlap, ties to the first). Stop rule, written before the run:
attention evidence is worth building into the capture (next session) only if some head set reaches >= 90 % top-1
on `phrase` answers, where the answer's words are few and lexical overlap is weakest.

    HALWATCH_DTYPE=float32 .venv/bin/python docs/results/smollm2-135m-evidence-dev/probe.py [N]
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import numpy as np

from halwatch.data.shapes import build_squad_shapes, sentence_around
from halwatch.data.splits import split_of
from halwatch.data.squad import read_squad
from halwatch.models import forward
from halwatch.models.signal_types import SignalRequest
from halwatch.scorer import Scorer

HERE = Path(__file__).resolve().parent
WORD = re.compile(r"\w+")


def sentences(context: str) -> list[tuple[int, int]]:
    cuts = [0] + [m.end() for m in re.finditer(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])", context)] + [len(context) + 1]
    return [(a, len(context[a:b - 1].rstrip()) + a) for a, b in zip(cuts, cuts[1:])]


def lexical(context: str, spans, response: str) -> int:
    words = set(WORD.findall(response.lower()))
    overlap = [len(words & set(WORD.findall(context[a:b].lower()))) for a, b in spans]
    return int(np.argmax(overlap))


def prompt_offsets(tokenizer, view) -> list[tuple[int, int]]:
    """Character offsets in the prompt of the view's prompt tokens (raw input: the tokenizer's own)."""
    enc = tokenizer(view.sample.prompt, add_special_tokens=True, return_offsets_mapping=True)
    assert list(enc["input_ids"]) == list(view.input_ids[:view.n_prompt]), "prompt tokens differ"
    return [tuple(o) for o in enc["offset_mapping"]]


def grounded(split: str, n: int) -> list:
    """Up to ``n`` grounded `phrase` and `sentence` answers of a split (a seeded draw, in file order)."""
    found = [s for s in build_squad_shapes() if split_of(s) == split and s.meta["shape"] in ("phrase", "sentence")]
    rng = np.random.default_rng(0)
    return [found[i] for i in sorted(rng.choice(len(found), size=min(n, len(found)), replace=False))]


def train_lookback(scorer, n: int) -> np.ndarray:
    """Each head's mean lookback ratio over ``n`` grounded answers of the train split."""
    request = SignalRequest(heads=scorer.model.all_heads(), reducers=("lookback",))
    return np.mean([forward.run(scorer.model, [scorer.encode(s)], request)[0].reduced["lookback.ratio"].mean(axis=1)
                    for s in grounded("train", n)], axis=0)


def main(n: int) -> None:
    scorer = Scorer(cache=None)
    sm = scorer.model
    gold_start = {q.id: q.answer_starts[0] for q in read_squad() if q.answer_starts}
    dev = grounded("dev", n)
    from_train = train_lookback(scorer, n)
    heads = sm.all_heads()
    n_layers = sm.n_layers
    request = SignalRequest(heads=heads, keep_attention=True, reducers=("lookback",))
    rows, t_attn, t_plain = [], 0.0, 0.0
    for sample in dev:
        view = scorer.encode(sample)
        t0 = time.perf_counter()
        forward.run(sm, [view], SignalRequest())
        t_plain += time.perf_counter() - t0
        t0 = time.perf_counter()
        sig = forward.run(sm, [view], request)[0]
        t_attn += time.perf_counter() - t0
        lo, hi = sample.context_span
        spans = sentences(sample.context)
        start = gold_start[sample.meta["question_id"]]
        gold_range = sentence_around(sample.context, start, start + 1)
        if gold_range is None:  # the gold answer's first character at a sentence cut: no one gold sentence
            continue
        gold = next(i for i, (a, b) in enumerate(spans) if a <= gold_range[0] < b + 1)
        # each prompt token's sentence (-1 outside the context)
        offsets = prompt_offsets(sm.tokenizer, view)
        token_sentence = np.full(view.n_prompt, -1)
        for t, (a, b) in enumerate(offsets):
            if b > a and lo <= a < hi:
                token_sentence[t] = next((i for i, (x, y) in enumerate(spans) if x <= a - lo < y + 1), -1)
        attention = sig.attention  # [heads, R, K] rows of the response tokens
        mass = attention[:, :, :view.n_prompt].sum(axis=1)  # [heads, prompt tokens]
        lookback = sig.reduced["lookback.ratio"].mean(axis=1) if "lookback.ratio" in sig.reduced else None
        counts = np.bincount(token_sentence[token_sentence >= 0], minlength=len(spans)).astype(float)
        row = {"id": sample.id, "shape": sample.meta["shape"], "gold": gold, "sentences": len(spans),
               "lexical": lexical(sample.context, spans, sample.response) == gold}
        sets = {"all heads": np.arange(len(heads)),
                "last third of the layers": np.array([i for i, (layer, _) in enumerate(heads)
                                                      if layer >= 2 * n_layers // 3])}
        row["lookback_by_head"] = None if lookback is None else lookback.tolist()
        for name, which in sets.items():
            per_token = mass[which].sum(axis=0)
            per_sentence = np.bincount(token_sentence[token_sentence >= 0],
                                       weights=per_token[token_sentence >= 0], minlength=len(spans))
            row[name] = int(np.argmax(per_sentence)) == gold
            row[name + ", per token"] = int(np.argmax(per_sentence / np.maximum(counts, 1))) == gold
        row["mass"] = mass.astype(np.float32)
        row["token_sentence"] = token_sentence
        rows.append(row)
    # the lookback-selected heads: top 10 % by mean lookback ratio over these answers (chosen on them: optimistic),
    # and over as many grounded answers of the train split
    chosen = {"top lookback heads, chosen on these answers":
              np.mean([r["lookback_by_head"] for r in rows], axis=0), "top lookback heads, chosen on train": from_train}
    for name, ratio in chosen.items():
        top = np.argsort(-ratio)[: max(1, len(heads) // 10)]
        for r in rows:
            ts = r["token_sentence"]
            per_token = r["mass"][top].sum(axis=0)
            per_sentence = np.bincount(ts[ts >= 0], weights=per_token[ts >= 0], minlength=r["sentences"])
            r[name] = int(np.argmax(per_sentence)) == r["gold"]
    overlap = len(set(np.argsort(-chosen["top lookback heads, chosen on train"])[:len(heads) // 10])
                  & set(np.argsort(-chosen["top lookback heads, chosen on these answers"])[:len(heads) // 10]))
    methods = [k for k in rows[0] if isinstance(rows[0][k], bool)]
    from halwatch.eval.protocols import source_commit

    out = {"commit": source_commit(), "dtype": sm.dtype, "answers": len(rows), "skipped": len(dev) - len(rows),
           "heads_in_both_choices": overlap,
           "seconds_per_answer": {"plain pass": t_plain / len(dev),
                                                         "pass keeping every head's rows": t_attn / len(dev)},
           "top1_in_gold_sentence": {}}
    for shape in ("phrase", "sentence"):
        mine = [r for r in rows if r["shape"] == shape]
        out["top1_in_gold_sentence"][shape] = {"answers": len(mine), "mean sentences": float(
            np.mean([r["sentences"] for r in mine]))} | {m: float(np.mean([r[m] for r in mine])) for m in methods}
    print(json.dumps(out, indent=1))
    (HERE / "probe.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 160)
