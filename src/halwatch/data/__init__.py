"""Dataset readers: generic JSONL (:mod:`.jsonl`), RAGTruth (:mod:`.ragtruth`), SQuAD 2.0 (:mod:`.squad`)."""

from __future__ import annotations

import os
from pathlib import Path

from halwatch.errors import HalwatchError


def data_root() -> Path:
    """Where the shared datasets are: ``$HALWATCH_DATA``, else ``../shared/data`` beside the checkout or the
    working directory."""
    if os.environ.get("HALWATCH_DATA"):
        return Path(os.environ["HALWATCH_DATA"])
    candidates = [
        Path(__file__).resolve().parents[3].parent / "shared" / "data",  # src/halwatch/data -> checkout/..
        Path.cwd().parent / "shared" / "data",
        Path.cwd() / "shared" / "data",
    ]
    for c in candidates:
        if c.is_dir():
            return c
    raise HalwatchError("cannot find the shared datasets: set HALWATCH_DATA to the folder holding ragtruth/ and "
                        "squad/")
