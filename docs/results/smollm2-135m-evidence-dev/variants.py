"""Issue 76, dev split only: variants of how attention becomes evidence, before the test split is read. Stop rule,
written before the run: a variant replaces the first rule (each response token's own attention row, summed over
the 27 chosen heads, every token of the answer) only if it gains >= 0.02 top-1 on the restated dev answers
without losing more than 0.01 on the copied ones.

Variants: the rows of the steps that generate each token (the query before it) instead of its own row; both; only
the tokens of content words (a word not in halwatch.signals.support.STOPWORDS); and attention mixed with the
lexical overlap (each context sentence's share of the answer's words it holds, added to its attention share).

    HALWATCH_DTYPE=float32 .venv/bin/python docs/results/smollm2-135m-evidence-dev/variants.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "smollm2-135m-evidence"))

from answers import WORD, copied, restated  # noqa: E402

from halwatch import evidence  # noqa: E402
from halwatch.eval.protocols import source_commit  # noqa: E402
from halwatch.models import forward  # noqa: E402
from halwatch.models.signal_types import SignalRequest  # noqa: E402
from halwatch.scorer import Scorer  # noqa: E402
from halwatch.sentences import sentence_ranges  # noqa: E402
from halwatch.signals.support import STOPWORDS  # noqa: E402


def main() -> None:
    scorer = Scorer(cache=None)
    sm = scorer.model
    heads = evidence.evidence_heads(sm)
    request = SignalRequest(heads=heads, keep_attention=True, attention_from="all")
    rows = copied("dev") + restated("dev", 10_000)
    hits: dict[str, list] = {}
    for row in rows:
        s = row["sample"]
        view = scorer.encode(s)
        sig = forward.run(sm, [view], request)[0]
        full = sig.attention.sum(axis=0)  # [n, n]: every token's row, the chosen heads summed
        p, r = view.n_prompt, view.n_response
        own, step = full[p:p + r, :p], full[p - 1:p - 1 + r, :p]
        units = sentence_ranges(s.context)
        base = s.context_span[0]
        starts = evidence.prompt_offsets(view, sm.tokenizer)
        last = np.where(starts[:, 1] > 0, starts[:, 1] - 1 - base, -1)
        unit = np.array([next((k for k, (a, b) in enumerate(units) if a <= c < b), -1) for c in last])
        ok = unit >= 0
        words = [w for w in WORD.findall(s.response.lower())]
        content = np.array([any(w.lower() not in STOPWORDS for w in WORD.findall(s.response[a:b]))
                            for a, b in view.offsets])
        lex = np.array([len(set(words) & set(WORD.findall(s.context[a:b].lower()))) for a, b in units], float)
        lex = lex / max(lex.sum(), 1)

        def share(mass, tokens=None):
            m = mass if tokens is None else mass[tokens]
            per = m.sum(axis=0)
            got = np.bincount(unit[ok], weights=per[ok], minlength=len(units))
            return got / max(got.sum(), 1e-12)

        variants = {"own rows, every token (the first rule)": share(own), "step rows": share(step), "own + step": share(own + step),
                    "own rows, content-word tokens": share(own, content if content.any() else None),
                    "own rows + lexical share": share(own) + lex}
        for name, w in variants.items():
            a, b = units[int(np.argmax(w))]
            hits.setdefault(name, []).append(a <= row["answer_start"] < b)
    out = {"commit": source_commit(), "dtype": sm.dtype, "split": "dev"}
    for kind, keep in (("copied", lambda r: r["kind"] != "restated"), ("restated", lambda r: r["kind"] == "restated"),
                       ("restated, overlap <= 0.5", lambda r: r["kind"] == "restated" and r["overlap"] <= 0.5)):
        idx = [i for i, r in enumerate(rows) if keep(r)]
        out[kind] = {"answers": len(idx), **{k: round(float(np.mean([v[i] for i in idx])), 3) for k, v in hits.items()}}
    print(json.dumps(out, indent=1))
    (HERE / "variants.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
