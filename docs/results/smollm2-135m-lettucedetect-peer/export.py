"""Write halwatch's RAGTruth QA splits in LettuceDetect's sample format (issue 75, the "peer" measurement).

Run with halwatch's venv:

    HALWATCH_HOME=/work/hwhome /work/main/.venv/bin/python export.py OUT_DIR

It writes OUT_DIR/train.json, OUT_DIR/dev.json and OUT_DIR/test.json, each a JSON list of dicts that
``lettucedetect.datasets.hallucination_dataset.HallucinationData.from_json`` reads (LettuceDetect 0.2.3), and
OUT_DIR/manifest.json (counts and ids per split).

The split of every answer is halwatch's own (:func:`halwatch.data.splits.split_of`): ``train`` (the official train
split minus halwatch's dev sources), ``dev`` (a fifth of the official train split's sources) and ``test``
(RAGTruth's official test split). The sample fields follow LettuceDetect's own RAGTruth preprocessing
(``lettucedetect/preprocess/preprocess_ragtruth.py``): ``prompt`` is RAGTruth's full generator prompt (the source's
``prompt``, which is halwatch's ``Sample.prompt``), ``answer`` is the response, and ``labels`` are the annotated
character spans ``{"start", "end", "label"}`` into the answer (empty for a grounded answer). ``context`` and
``question`` are filled too (LettuceDetect's training reads only ``prompt``, ``answer`` and ``labels``).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from halwatch.data.splits import split_of
from halwatch.eval.datasets import load_dataset

DATASET = "ragtruth:all"  # RAGTruth QA, the three open generators, both official splits


def to_lettuce(sample, split: str) -> dict:
    """One halwatch Sample as a LettuceDetect ``HallucinationSample`` JSON dict."""
    labels = [{"start": int(s["start"]), "end": int(s["end"]), "label": s.get("label_type")} for s in sample.spans]
    assert bool(labels) == bool(sample.label), f"label and spans disagree for {sample.id}"
    return {
        "prompt": sample.prompt,
        "answer": sample.response,
        "labels": labels,
        "split": split,
        "task_type": "qa",
        "dataset": "ragtruth",
        "language": "en",
        "context_modality": "prose",
        "category": None,
        "subcategory": None,
        "context": sample.context_text,
        "question": sample.meta.get("question"),
        "metadata": {"id": sample.id, "source": sample.source, "model": sample.meta.get("model"),
                     "quality": sample.meta.get("quality"), "halwatch_label": int(sample.label)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder to write train.json, dev.json, test.json into")
    args = parser.parse_args()

    samples, _ = load_dataset(DATASET)
    by_split: dict[str, list[dict]] = {"train": [], "dev": [], "test": []}
    for sample in samples:
        split = split_of(sample)
        if split in by_split:
            by_split[split].append(to_lettuce(sample, split))

    # the three splits share no source (RAGTruth's official split and halwatch's dev carve are by source)
    sources = {k: {r["metadata"]["source"] for r in v} for k, v in by_split.items()}
    assert not (sources["train"] & sources["dev"]) and not (sources["train"] & sources["test"])
    assert not (sources["dev"] & sources["test"])

    args.out_dir.mkdir(parents=True, exist_ok=True)
    manifest = {"dataset": DATASET, "splits": {}}
    for split, rows in by_split.items():
        (args.out_dir / f"{split}.json").write_text(json.dumps(rows, ensure_ascii=False))
        counts = Counter(bool(r["labels"]) for r in rows)
        manifest["splits"][split] = {"answers": len(rows), "hallucinated": counts[True],
                                     "sources": len(sources[split]), "ids": [r["metadata"]["id"] for r in rows]}
        print(f"{split}: {len(rows)} answers, {counts[True]} hallucinated, {len(sources[split])} sources "
              f"-> {args.out_dir / f'{split}.json'}")
    (args.out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    main()
