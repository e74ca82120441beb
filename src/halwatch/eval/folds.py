"""The train / test splits of the benchmark protocols (:func:`make_splits`), every one by source document."""

from __future__ import annotations

import numpy as np

from halwatch.errors import InputError

#: The protocols :func:`make_splits` draws (``transfer`` and ``shape-transfer`` are :class:`halwatch.eval.protocols.
#: Bench`'s own).
SPLIT_PROTOCOLS = ("dev", "official", "ragtruth-official", "random-splits", "kfold")


def subset(indices, labels, size, seed):
    """A stratified random subset of ``size`` of ``indices`` (all of them when size is None or too large)."""
    from sklearn.model_selection import train_test_split

    indices = np.asarray(indices)
    if size is None or size >= len(indices):
        return indices
    part, _ = train_test_split(indices, train_size=size, stratify=labels[indices], random_state=seed)
    return np.sort(part)


def make_splits(protocol: str, samples, seeds, probe_size=None):
    """``[(seed, probe_indices, test_indices)]`` of a protocol. Every split keeps the answers to one source document
    (:attr:`halwatch.sample.Sample.source`) on one side.

    - ``dev``: probe = the train split (:func:`halwatch.data.splits.split_of`; or a stratified subset of
      ``probe_size``, varied by the seed), test = the dev split. Where every design choice is made.
    - ``official`` (``ragtruth-official``): probe = the train and dev splits (RAGTruth's official train split),
      test = the test split. Read once per published table.
    - ``random-splits`` (TOHA section 4.1, after HaloScope): a stratified 75/25 split by source per seed, probe =
      ``probe_size`` (default 100) of the 75 %.
    - ``kfold`` (LRP4RAG section 3.4): stratified 5-fold cross-validation by source over the whole set, fitting on
      the four other folds; the "seed" of a row is the fold number. Nothing is selected on the test fold.
    """
    from sklearn.model_selection import StratifiedGroupKFold

    from halwatch.data.splits import split_of

    labels = np.array([s.label for s in samples])
    groups = np.array([s.source for s in samples])
    everything = np.arange(len(samples))
    splits = np.array([split_of(s) for s in samples])
    if protocol in ("dev", "official", "ragtruth-official"):
        train = everything[np.isin(splits, ["train"] if protocol == "dev" else ["train", "dev"])]
        test = everything[splits == ("dev" if protocol == "dev" else "test")]
        if not len(train) or not len(test):
            raise InputError(f"protocol {protocol!r} needs samples of the train and "
                             f"{'dev' if protocol == 'dev' else 'test'} splits (meta.split)")
        return [(seed, subset(train, labels, probe_size, seed), test) for seed in seeds]
    if protocol == "random-splits":
        out = []
        for seed in seeds:
            rest, test = next(StratifiedGroupKFold(4, shuffle=True, random_state=seed).split(everything, labels,
                                                                                               groups))
            out.append((seed, subset(rest, labels, probe_size or 100, seed), np.sort(test)))
        return out
    if protocol == "kfold":
        folds = StratifiedGroupKFold(n_splits=5, shuffle=True, random_state=seeds[0])
        return [(k, subset(tr, labels, probe_size, seeds[0]), te)
                for k, (tr, te) in enumerate(folds.split(everything, labels, groups))]
    raise ValueError(f"unknown protocol {protocol!r}: choose one of {', '.join(SPLIT_PROTOCOLS)}")
