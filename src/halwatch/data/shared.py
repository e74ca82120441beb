"""Readers of the labelled faithfulness sets of other shapes in ``../shared/data`` (summaries, dialogue replies,
reports written from data), each in halwatch's generic record shape, and the split every sample falls in.

Each set is read with the task whose template renders it (:data:`halwatch.sample.TEMPLATES`), its source document as
``meta["source_id"]`` (so that folds and splits never part the answers to one document) and a ``meta["split"]``:
``train``, ``dev`` or ``test``, drawn from a hash of the source
(:func:`halwatch.data.splits.split_of_source`, 60 / 20 / 20 %), the same on every machine and run. Sets whose
licence allows evaluation only (FaithBench) are all ``test``.

Some sets hold many answers per document (SummEdits about 28). ``per_source`` keeps at most that many per document,
seeded and alternating labels where a document has both, so that a benchmark's forward passes stay affordable on a
CPU; :data:`SETS` gives each set's default and the reasons.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from halwatch.data import data_root
from halwatch.data.splits import split_of_source
from halwatch.errors import InputError
from halwatch.sample import Sample


@dataclass(frozen=True)
class SharedSet:
    folder: str
    task: str
    per_source: int | None  # default cap of answers per source document
    trainable: bool  # the licence allows fitting a shipped artifact on it
    note: str


SETS = {
    "faithbench": SharedSet("faithbench", "summary", None, False,
                            "news and other summaries by 10 recent LLMs; CC BY-NC-SA: evaluation only, all test"),
    "xsum-hallucination": SharedSet("xsum_hallucination", "summary", 2, True,
                                    "XSum summaries of 4 systems and the reference, 3-annotator majority spans; 2 of "
                                    "the 5 per document"),
    "summedits": SharedSet("summedits", "summary", 6, True,
                           "edited summaries in 8 domains, no spans; 6 of about 28 per document"),
    "bump": SharedSet("bump", "summary", 2, True,
                      "CNN/DailyMail reference summaries and one-error edits (spans from the diff); 2 per document"),
    "diasumfact": SharedSet("diasumfact", "summary", None, True,
                            "chat and meeting summaries with human error spans (meetings with their query)"),
    "begin": SharedSet("begin", "dialogue", 1, True,
                       "knowledge-grounded dialogue replies of 4 models, no spans; 1 per knowledge snippet"),
    "faithdial": SharedSet("faithdial_audit", "dialogue", 2, True,
                           "knowledge-grounded dialogue replies of 3 models and people, no spans; 2 per snippet"),
    "rotowire": SharedSet("rotowire_accuracy", "data2text", 4, True,
                          "NBA game reports written from box scores, one sample per sentence (label 1 where a "
                          "human-annotated error falls in it); 4 sentences per game"),
}


def _records(path: Path) -> list[dict]:
    if not path.is_file():
        raise InputError("file not found", str(path))
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _sentences(text: str) -> list[tuple[int, int]]:
    """Character ranges of the sentences of a (tokenised) report: cut after ``.``, ``!`` or ``?`` and a space."""
    out, start = [], 0
    for m in re.finditer(r"[.!?](?:\s+)", text):
        end = m.start() + 1
        if text[start:end].strip():
            out.append((start, end))
        start = m.end()
    if text[start:].strip():
        out.append((start, len(text.rstrip())))
    return out


def _by_sentence(record: dict) -> list[dict]:
    """One record per sentence of the response, labelled 1 where a gold span overlaps it (spans moved with it)."""
    out = []
    for k, (a, b) in enumerate(_sentences(record["response"])):
        spans = [{"start": max(s["start"], a) - a, "end": min(s["end"], b) - a}
                 for s in record.get("spans") or [] if s["start"] < b and a < s["end"]]
        out.append({**record, "id": f"{record['id']}-s{k}", "response": record["response"][a:b],
                    "label": int(bool(spans)), "spans": spans, "meta": {**record.get("meta", {}), "sentence": k}})
    return out


def cap_per_source(samples: list[Sample], per_source: int | None, seed: int = 0) -> list[Sample]:
    """At most ``per_source`` samples of each source, chosen with ``seed``: labels alternate (a grounded one, a
    hallucinated one, ...) while a source has both. The input order is kept."""
    if not per_source:
        return samples
    rng = random.Random(seed)
    by_source: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        by_source.setdefault(s.source, []).append(i)
    keep = set()
    for indices in by_source.values():
        pools = {0: [], 1: []}
        for i in indices:
            pools[int(samples[i].label or 0)].append(i)
        for pool in pools.values():
            rng.shuffle(pool)
        turn = rng.randrange(2)
        for _ in range(min(per_source, len(indices))):
            keep.add((pools[turn] or pools[1 - turn]).pop())
            turn = 1 - turn
    return [s for i, s in enumerate(samples) if i in keep]


def read_shared(name: str, root: str | Path | None = None, per_source: int | None | str = "default",
                seed: int = 0) -> list[Sample]:
    """The samples of one set of :data:`SETS`, with ``meta["source_id"]``, ``meta["split"]`` and ``meta["dataset"]``
    (the upstream split, if any, moves to ``meta["upstream_split"]``). ``per_source``: at most that many answers per
    source document (``"default"``: the set's own cap; ``None``: all)."""
    from halwatch.data.jsonl import sample_from_record

    if name not in SETS:
        raise InputError(f"unknown dataset {name!r}: the shared sets are {', '.join(SETS)}")
    spec = SETS[name]
    path = (Path(root) if root else data_root()) / spec.folder / f"{spec.folder}.jsonl.gz"
    records = _records(path)
    if name == "rotowire":
        records = [r for record in records for r in _by_sentence(record)]
    samples = []
    for lineno, record in enumerate(records, start=1):
        meta = dict(record.get("meta") or {})
        if "split" in meta:
            meta["upstream_split"] = meta.pop("split")
        source = "doc:" + hashlib.sha256(record["context"].encode("utf-8")).hexdigest()[:16]
        meta.update(dataset=name, source_id=source,
                    split="test" if not spec.trainable else split_of_source(f"{name}/{source}"))
        record = {**record, "meta": meta, "task": spec.task}
        if not (record.get("question") or "").strip():
            record.pop("question", None)
        samples.append(sample_from_record(record, f"{path}:{lineno}"))
    cap = spec.per_source if per_source == "default" else per_source
    return cap_per_source(samples, cap, seed)
