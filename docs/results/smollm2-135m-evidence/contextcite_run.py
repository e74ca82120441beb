"""ContextCite (Cohen-Wang et al. 2024, ``context-cite`` 0.0.4 from PyPI) on the answers of answers.jsonl (written
by measure.py), in its own environment (it pins its own dependencies; see commands.txt): the same scoring model
(SmolLM2-135M-Instruct, float32, CPU), its own prompt template and the model's chat template, its default 64
ablations and Lasso surrogate, the given answer instead of one it generates, and the context cut into the same
sentences halwatch's evidence uses (its own cut needs NLTK data this machine cannot download). Writes each answer's
top source (character range in the context) and seconds to contextcite.jsonl, resuming where it stopped. N: the
first N answers of each kind (phrase, sentence, restated); ``--kinds`` and ``--max-overlap`` pick instead every
answer of those kinds whose overlap with the gold sentence is at most that.

    /work/ccvenv/bin/python docs/results/smollm2-135m-evidence/contextcite_run.py MODEL_FOLDER [N]
        [--answers answers.jsonl] [--kinds restated generated --max-overlap 0.5]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from context_cite import ContextCiter
from context_cite.context_partitioner import BaseContextPartitioner
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = Path(__file__).resolve().parent


class Sentences(BaseContextPartitioner):
    """The context cut at the given character ranges; an ablated context keeps the text between kept sentences."""

    def __init__(self, context: str, units: list[list[int]]):
        super().__init__(context)
        self.units = [tuple(u) for u in units]

    @property
    def num_sources(self) -> int:
        return len(self.units)

    def split_context(self) -> None:
        pass

    def get_source(self, index: int) -> str:
        a, b = self.units[index]
        return self.context[a:b]

    def get_context(self, mask=None) -> str:
        keep = np.ones(len(self.units), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
        return " ".join(self.get_source(i) for i in range(len(self.units)) if keep[i])


def main(folder: str, n: int | None, answers: str, kinds: list[str] | None, max_overlap: float) -> None:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    rows = [json.loads(line) for line in (HERE / answers).read_text().splitlines()]
    out = HERE / "contextcite.jsonl"
    done = {json.loads(line)["id"] for line in out.read_text().splitlines()} if out.exists() else set()
    if kinds:
        picked = [r for r in rows if r["kind"] in kinds and r["overlap"] <= max_overlap]
    else:
        picked = rows if n is None else [r for kind in ("phrase", "sentence", "restated")
                                         for r in [x for x in rows if x["kind"] == kind][:n]]
    with open(out, "a", encoding="utf-8") as f:
        for row in picked:
            if row["id"] in done:
                continue
            t0 = time.perf_counter()
            cc = ContextCiter(model, tokenizer, row["context"], row["question"],
                              partitioner=Sentences(row["context"], row["units"]))
            _, prompt = cc._get_prompt_ids(return_prompt=True)
            cc._cache["output"] = prompt + row["response"]  # the given answer, not a generated one
            scores = cc.get_attributions(verbose=False)
            top = row["units"][int(np.argmax(scores))]
            f.write(json.dumps({"id": row["id"], "top": top, "seconds": time.perf_counter() - t0}) + "\n")
            f.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("n", nargs="?", type=int)
    parser.add_argument("--answers", default="answers.jsonl", help="file in this folder, written by measure.py")
    parser.add_argument("--kinds", nargs="*")
    parser.add_argument("--max-overlap", type=float, default=1.0)
    args = parser.parse_args()
    main(args.folder, args.n, args.answers, args.kinds, args.max_overlap)
