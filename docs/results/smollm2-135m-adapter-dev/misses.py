"""Where the adapter's spans miss on RAGTruth's dev answers: per human span, the share of its characters inside the
adapter's spans (under the rule saved with the adapter), by span length. Usage: misses.py WORK TAG (after
``train.py WORK dev TAG``, which saves the token log-odds)"""

import sys
from pathlib import Path

import numpy as np
import torch
from train import spans_of

from halwatch.data.splits import split_of
from halwatch.eval.datasets import load_dataset
from halwatch.models.loader import load_model
from halwatch.tokens import encode


def main(work, tag):
    saved = torch.load(Path(work) / f"adapter-{tag}.pt", weights_only=False)
    logits = np.load(Path(work) / f"dev-{tag}-dev-tokens.npy", allow_pickle=True)
    tokenizer = load_model("smollm2-135m").tokenizer
    samples = [s for s in load_dataset("ragtruth:all")[0] if split_of(s) == "dev"]
    views = [encode(sample, tokenizer, "raw") for sample in samples]
    cover, length = [], []
    for sample, spans in zip(samples, spans_of(views, logits, saved["threshold"], saved["rule"])):
        flagged = np.zeros(len(sample.response), dtype=bool)
        for span in spans:
            flagged[span["start"]:span["end"]] = True
        for gold in sample.spans:
            cover.append(flagged[gold["start"]:gold["end"]].mean())
            length.append(gold["end"] - gold["start"])
    cover, length = np.array(cover), np.array(length)
    print(f"{len(cover)} human spans, median {np.median(length):.0f} characters; no character flagged "
          f"{(cover == 0).mean():.2f}, partly {((cover > 0) & (cover < 0.8)).mean():.2f}, at least 80 % "
          f"{(cover >= 0.8).mean():.2f}")
    print("| span length (characters) | spans | share of the gold characters | no character flagged | character recall |")
    print("| --- | --- | --- | --- | --- |")
    for low, high in ((0, 30), (30, 100), (100, None)):
        m = (length >= low) & (length < (high or np.inf))
        print(f"| {low}-{high or ''} | {m.sum()} | {length[m].sum() / length.sum():.2f} | {(cover[m] == 0).mean():.2f} | "
              f"{(cover[m] * length[m]).sum() / length[m].sum():.2f} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
