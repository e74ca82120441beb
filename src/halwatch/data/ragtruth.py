"""RAGTruth (Niu et al., 2024) QA responses joined with their sources on ``source_id``.

Each response becomes a :class:`Sample` with the source's full ``prompt`` (the instruction that was sent to the
generator), ``context_span`` on the passages inside it (so a long prompt is cut inside the passages and keeps the
question), ``label`` 1 when the response has at least one annotated span, the annotated ``spans``, and ``meta``
with ``model``, ``split`` (the official one), ``dev`` (whether the source belongs to the dev split carved from the
official train split, :mod:`halwatch.data.splits`), ``quality``, ``source_id``, ``temperature`` and the source's
``question`` (so that the same answer can be rendered through another template with the passages of
``context_span``).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from halwatch.data import data_root
from halwatch.data.splits import in_dev
from halwatch.errors import InputError
from halwatch.sample import Sample

RESPONSES = "response.qa_open_models.jsonl.gz"
SOURCES = "source_info.qa.jsonl.gz"
GENERATORS = ("llama-2-7b-chat", "llama-2-13b-chat", "mistral-7B-instruct")
SPLITS = ("train", "test")
QUALITIES = ("good", "incorrect_refusal", "truncated")


def _read(path: Path) -> list[dict]:
    if not path.is_file():
        raise InputError("file not found", str(path))
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _as_set(value, allowed, what) -> set | None:
    if value is None:
        return None
    values = {value} if isinstance(value, str) else set(value)
    unknown = values - set(allowed)
    if unknown:
        raise InputError(f"unknown RAGTruth {what} {sorted(unknown)}: choose from {', '.join(allowed)}")
    return values


def read_ragtruth(root: str | Path | None = None, generator=None, split=None, quality=None) -> list[Sample]:
    """QA samples, filtered by generator ``model``, official ``split`` and ``quality`` (each a name or a list)."""
    root = Path(root) if root else data_root() / "ragtruth"
    generators = _as_set(generator, GENERATORS, "generator")
    splits = _as_set(split, SPLITS, "split")
    qualities = _as_set(quality, QUALITIES, "quality")
    sources = {s["source_id"]: s for s in _read(root / SOURCES)}
    samples = []
    for r in _read(root / RESPONSES):
        if generators and r["model"] not in generators or splits and r["split"] not in splits:
            continue
        if qualities and r["quality"] not in qualities:
            continue
        source = sources.get(r["source_id"])
        if source is None:
            raise InputError(f"source_id {r['source_id']} has no source", f"{RESPONSES} (id={r['id']})")
        prompt, passages = source["prompt"], source["source_info"]["passages"]
        start = prompt.find(passages)
        samples.append(
            Sample(
                id=r["id"],
                prompt=prompt,
                response=r["response"],
                label=int(bool(r["labels"])),
                spans=[{"start": s["start"], "end": s["end"], "label_type": s["label_type"]} for s in r["labels"]],
                context_span=(start, start + len(passages)) if start >= 0 else None,
                meta={**{k: r[k] for k in ("model", "split", "quality", "source_id", "temperature")},
                      "dev": r["split"] == "train" and in_dev(f"ragtruth/{r['source_id']}"), "dataset": "ragtruth",
                      "question": source["source_info"]["question"]},
            )
        )
    return samples


def seeded_sample(n: int | None = None, seed: int = 0) -> list[Sample]:
    """``n`` answers of the official test split, a seeded sample (all of them with ``None`` or more than there are):
    what every speed measure times."""
    import random

    pool = read_ragtruth(split="test")
    return random.Random(seed).sample(pool, min(n or len(pool), len(pool)))
