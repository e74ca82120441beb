"""Which split every sample falls in, by its source document, the same on every machine and run.

halwatch makes every design choice (features, regularisation, thresholds, span rules, the default detector) on a
**dev** split and reads a **test** split once per published table. RAGTruth keeps its official train / test split
(``meta["split"]``); its dev split is a fifth of the official train split's sources (``meta["dev"]``, drawn by
:func:`source_fraction`), so train and dev share no source. Sets without an official split are cut by source into
train / dev / test (:data:`SHARES`).
"""

from __future__ import annotations

import hashlib
import re

SPLITS = ("train", "dev", "test")
#: Shares of sources in the train, dev and test splits of a set without an official split.
SHARES = (0.6, 0.2, 0.2)
#: Share of the official train split's sources that RAGTruth's dev split takes.
DEV_SHARE = 0.2


def source_fraction(source: str) -> float:
    """A number in [0, 1) drawn from a hash of ``source``: the same on every machine."""
    return int(hashlib.sha256(source.encode("utf-8")).hexdigest()[:12], 16) / 16 ** 12


def split_of_source(source: str, shares=SHARES) -> str:
    """``train``, ``dev`` or ``test`` for a source document, by :func:`source_fraction`."""
    u = source_fraction(source)
    return "train" if u < shares[0] else "dev" if u < shares[0] + shares[1] else "test"


def in_dev(source: str) -> bool:
    """Whether a source of an official train split belongs to the dev split carved from it."""
    return source_fraction(f"dev/{source}") < DEV_SHARE


def split_of(sample) -> str | None:
    """The split a sample is used in: ``meta["split"]``, with ``train`` turned ``dev`` where ``meta["dev"]`` says so
    (``None`` where the sample has no split)."""
    split = sample.meta.get("split")
    return "dev" if split == "train" and sample.meta.get("dev") else split


def describe_fit_data(datasets, split: str, said: str | None = None) -> str:
    """What an artifact fitted on named datasets records as ``fitted_on.data``: "NAME, NAME: split PARTS", after the
    user's own description where one was given ("SAID; NAME: split PARTS"), read back by :func:`fit_data_of`."""
    standard = f"{', '.join(datasets)}: split {split}"
    return f"{said}; {standard}" if said else standard


def fit_data_of(described: str) -> tuple[set[str], list[str]] | None:
    """The datasets and split parts of a :func:`describe_fit_data` text, or ``None`` where it names none (an artifact
    fitted on a file)."""
    found = re.search(r"(?:^|; )([^;]+): split ([\w+]+)$", str(described))
    if not found:
        return None
    names, split = found.groups()
    return {n.strip() for n in names.split(",")}, split.split("+")
