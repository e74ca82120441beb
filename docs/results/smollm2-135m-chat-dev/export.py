"""Export a third of RAGTruth's train sources (no dev source), in three renderings, as generic JSONL.

Sources kept: official train split, not dev, source_fraction("sub/ragtruth/<source_id>") < 1/3.
Each file reads back to the same prompt, response, context span, label, spans and meta as the named dataset.
"""
import sys

from halwatch.data.jsonl import read_jsonl, sample_record, write_jsonl
from halwatch.data.splits import source_fraction, split_of
from halwatch.eval.datasets import load_dataset

OUT = {"ragtruth:all": "ragtruth-third.jsonl", "ragtruth-qa:all": "ragtruth-qa-third.jsonl",
       "ragtruth-chat:all": "ragtruth-chat-third.jsonl"}


def kept(s):
    return split_of(s) == "train" and source_fraction(f"sub/ragtruth/{s.meta['source_id']}") < 1 / 3


for name, path in OUT.items():
    samples = [s for s in load_dataset(name)[0] if kept(s)]
    records = []
    for s in samples:
        r = sample_record(s)
        r.update(label=s.label, spans=list(s.spans), meta=dict(s.meta))
        records.append(r)
    write_jsonl(path, records)
    back = read_jsonl(path)
    bad = sum((a.prompt, a.response, a.context_span, a.label, a.source, split_of(a))
              != (b.prompt, b.response, b.context_span, b.label, b.source, split_of(b)) for a, b in zip(samples, back))
    print(name, len(samples), "sources", len({s.source for s in samples}), "mismatches", bad, file=sys.stderr)
