"""Evaluation protocols of the papers on the detector contract (:class:`Bench`), on cached white-box signals."""

from __future__ import annotations

import logging
import time

import numpy as np

from halwatch.errors import InputError
from halwatch.eval.datasets import load_dataset
from halwatch.eval.folds import make_splits, subset
from halwatch.eval.metrics import evaluate, span_scores
from halwatch.files import replaced
from halwatch.models.forward import whitebox_request
from halwatch.models.signal_types import SignalRequest
from halwatch.sample import task_of

log = logging.getLogger("halwatch")


PROTOCOLS = ("dev", "official", "ragtruth-official", "random-splits", "kfold", "transfer", "shape-transfer")

#: The split each protocol's result rows are computed on (a row's ``"split"``; shape-transfer's is its
#: ``eval_split``), as :func:`make_splits` and :meth:`Bench._transfer` draw the scored answers.
SCORED_SPLIT = {
    "dev": "dev", "official": "test", "ragtruth-official": "test",
    "transfer": "test",  # the target's test split (``meta.split``; every answer of a set that has none)
    "random-splits": "random",  # a stratified 25 % by source of the whole set, whatever each answer's split
    "kfold": "fold",  # one of five folds by source of the whole set, whatever each answer's split
}


def source_commit() -> str:
    """The commit of the code that runs (``git describe``), ``-dirty`` when the tree had changes."""
    import subprocess
    from pathlib import Path

    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class Bench:
    """Runs detectors under a protocol on cached white-box signals; collects result rows and test predictions."""

    def __init__(self, scorer, detectors, options: dict | None = None, progress: bool = True):
        self.scorer = scorer
        self.detectors = list(detectors)
        self.options = options or {}
        self.progress = progress
        self.rows: list[dict] = []
        self.predictions: list[dict] = []
        self.commit = source_commit()
        self._data: dict = {}

    def data(self, name: str, request: SignalRequest | None = None, needed=None):
        """Samples, labels, views and signals of a dataset: the signals of the shared white-box pass, or of
        ``request`` where that pass does not cover it (from the disk cache, or one forward pass each). Only the
        samples at indices ``needed`` (default: all) are sure to have signals; others may be ``None``."""
        if name not in self._data:
            samples, generator = load_dataset(name)
            kept, views = [], []
            for s, found in zip(samples, self.scorer.encode_many(samples, windows=False, keep_errors=True)):
                if isinstance(found, InputError):
                    log.warning("%s: dropped %s", name, found)
                else:
                    views += found
                    kept.append(s)
            self._data[name] = (kept, np.array([s.label for s in kept]), views, generator, {})
        kept, labels, views, generator, by_request = self._data[name]
        whitebox = whitebox_request(self.scorer.model)
        request = whitebox if request is None or whitebox.covers(request) else request
        signals = by_request.setdefault(request, [None] * len(kept))
        todo = [i for i in (range(len(kept)) if needed is None else sorted(set(map(int, needed))))
                if signals[i] is None]
        if todo:
            for i, sig in zip(todo, self.scorer.signals([kept[i] for i in todo], request, progress=self.progress,
                                                        views=[views[i] for i in todo])):
                signals[i] = sig
        return kept, labels, views, signals, generator

    def _detector_data(self, name: str, detector_name: str, options=None, needed=None):
        from halwatch.detectors import create_detector

        template = create_detector(detector_name, scorer=self.scorer,
                                   **{**self.options.get(detector_name, {}), **(options or {})})
        return self.data(name, template.request(), needed)

    def score_answers(self, det, views, signals) -> tuple[tuple, dict, np.ndarray]:
        """``((probabilities, ranking scores), span figures, thresholds)`` of a fitted detector on answers (one view
        and its signals each), every long context scored in windows (:meth:`halwatch.scorer.Scorer.windowed`,
        :meth:`halwatch.detectors.base.Detector.answer_scores`). A detector with one part per task is judged by the
        part of the answers' task: span figures need one task, and a set of several tasks has none. Refused where
        the detector's adapter (setting ``adapter``) was trained on a source of the answers."""
        seen = getattr(det, "adapter_trained_on", lambda _: [])(views)
        if seen:
            raise InputError(f"{len(seen)} of the {len(views)} answers to score share a source with the answers "
                             f"the detector's adapter was trained on (first: {views[seen[0]].sample.id}): its scores "
                             "of them would not be held out; score another split or fit the adapter without them")
        tasks = {task_of(v.sample) for v in views}
        flat_views, flat_signals = self.scorer.windowed(views, signals, det.request(), self.progress)
        _, probs, ranking, thresholds, tokens = det.answer_scores(flat_views, flat_signals)
        spans = self.span_metrics(det.for_task(tasks.pop()), signals, views, probs, tokens) if len(tasks) == 1 else {}
        return (probs, ranking), spans, thresholds

    @staticmethod
    def span_metrics(det, signals, views, probs, tokens=None) -> dict:
        """Span-level figures of a fitted detector on test responses that have gold spans: character-level
        precision, recall and F1 of its flagged spans (and the F1 of flagging every character), the share of grounded
        answers left without a span, the span F1 of each answer shape where the set has several, and, for a detector
        with a window classifier (Lookback Lens), AUROC, AUC-PR and F1 over the test windows (``window_*``); with
        the span rule and its F1 on the training answers it was chosen on. ``tokens``: the answers' token scores
        where they are at hand (else from ``signals``)."""
        from halwatch.detectors.spans import describe_rule

        if det.span.threshold is None or not any(v.sample.spans for v in views):
            return {}
        gold = [v.sample.spans for v in views]
        tokens = det.outputs(signals)[1] if tokens is None else tokens
        predicted = [det.token_spans(v, t, float(p)) for v, t, p in zip(views, tokens, probs)]
        out = span_scores(predicted, gold)
        everything = [[{"start": 0, "end": len(v.sample.response)}] for v in views]  # flag every character
        out["span_trivial_f1"] = span_scores(everything, gold)["span_f1"]
        clean = [not spans for spans, v in zip(predicted, views) if v.sample.label == 0]
        if clean:
            out["grounded_without_span"] = float(np.mean(clean))  # spans that do not cry wolf
        shapes = sorted({str(v.sample.meta["shape"]) for v in views if "shape" in v.sample.meta})
        if len(shapes) > 1:  # a set built of several answer shapes (squad-shapes): each shape's span F1
            out["span_f1_by_shape"] = {shape: span_scores(
                [p for p, v in zip(predicted, views) if str(v.sample.meta.get("shape")) == shape],
                [v.sample.spans for v in views if str(v.sample.meta.get("shape")) == shape])["span_f1"]
                for shape in shapes}
        out["span_rule"] = describe_rule(det.span.rule)  # chosen on the training answers (detectors.spans)
        if "span_fit" in det.fitted_on:
            out["span_fit_f1"] = det.fitted_on["span_fit"]["f1"]  # its F1 there, held out for a supervised detector
        if getattr(det, "window_model", None) is not None:
            x, y = det.window_data(signals, views)
            found = evaluate(y, det.window_probabilities(x), det.window_threshold, det.window_logodds(x))
            out |= {f"window_{k}": found[k] for k in ("auroc", "auc_pr", "f1", "trivial_f1", "n_test")}
        return out

    def fit_score(self, detector_name, train, test, options=None):
        """Fit a fresh detector on ``train`` = (signals, labels, views), calibrated on the answers as scoring sees
        them (long contexts in windows), and score ``test`` signals: ``(detector, (probabilities, ranking
        scores))``."""
        from halwatch.detectors import create_detector

        det = create_detector(detector_name, scorer=self.scorer, **{**self.options.get(detector_name, {}),
                                                                    **(options or {})})
        signals, labels, views = train
        det.fit_signals(signals, labels, views, scored=det.scored_views(views, signals, self.progress))
        return det, det.scores_and_ranking(test) if test else None

    def _fitted(self, detector_name, train, options, what: str):
        """:meth:`fit_score`'s detector fitted on ``train``, or ``None`` where these answers cannot fit it (one
        label only; a routed detector without its fallback task): the bench says why in one line, skips the rows
        of that fit and goes on."""
        try:
            return self.fit_score(detector_name, train, [], options)[0]
        except InputError as exc:
            log.warning("%s fitted on %s: not fitted, its rows skipped: %s", detector_name, what, exc)
            return None

    def _fit_and_record(self, det_name, fit_on, score_on, options, what: str, row: tuple, extra, probe_size) -> None:
        """Fit ``det_name`` on ``fit_on`` and record its row on ``score_on`` (each ``(signals, labels, views,
        indices)``); ``row``: the row's ``(dataset, generator, protocol, seed)``. A fit these answers cannot make
        records nothing (:meth:`_fitted`)."""
        signals, labels, views, probe = fit_on
        t0 = time.perf_counter()
        det = self._fitted(det_name, ([signals[i] for i in probe], labels[probe], [views[i] for i in probe]), options,
                           what)
        if det is None:
            return
        signals, labels, views, test = score_on
        scored, spans, thresholds = self.score_answers(det, [views[i] for i in test], [signals[i] for i in test])
        self._record(*row, det_name, labels[test], scored, thresholds, time.perf_counter() - t0,
                     {**(extra or {}), **spans}, probe_size=probe_size)

    def _record(self, dataset, generator, protocol, seed, detector, labels, scored, threshold, seconds, extra=None,
                probe_size=None, split=None):
        """One result row and the test predictions: ``scored`` = (probabilities, ranking scores); AUROC and AUC-PR
        rank by the ranking score, which predictions.jsonl keeps as ``raw``. The row's ``split`` is the split its
        figures were computed on: ``split``, else the protocol's (:data:`SCORED_SPLIT`)."""
        probs, ranking = scored
        identity = {k: v for k, v in self.scorer.identity().items() if k in ("scoring_model", "input_mode", "dtype")}
        row = {
            "dataset": dataset, "generator": generator, "probe_size": probe_size or "all", **identity,
            "windows": self.scorer.windows,  # the most windows a long test context was scored in (1: left cut)
            "detector": detector, "protocol": protocol, "split": split or SCORED_SPLIT[protocol], "seed": int(seed),
            **evaluate(labels, probs, threshold, ranking), "seconds": round(seconds, 3), "commit": self.commit,
            "dirty": self.commit.endswith("-dirty"), **(extra or {}),
        }
        self.rows.append(row)
        self.predictions.append({k: row[k] for k in ("dataset", "detector", "protocol", "seed", "input_mode",
                                                     "dtype", "probe_size")}
                                | {"labels": [int(x) for x in labels], "probs": [float(p) for p in probs],
                                   "raw": [float(r) for r in ranking]})
        return row

    def run(self, protocol: str, datasets, seeds=(0, 1, 2, 3, 4), probe_size=None, options=None, extra=None,
            eval_split: str = "dev", never=(), hold_out=None, artifacts=()):
        """One protocol over datasets (``transfer``: every ordered pair of datasets; ``shape-transfer``: every
        dataset held out of a pooled fit in turn, on its ``eval_split``, and the ``never`` datasets scored by the
        pooled fit without ever being trained on; ``hold_out``: only these datasets get a held-out fit;
        ``artifacts``: fitted artifacts scored as they are, shape-transfer only)."""
        if protocol == "shape-transfer":
            return self.run_shapes(datasets, eval_split, options, extra, never=never, hold_out=hold_out,
                                   artifacts=artifacts)
        if artifacts:
            raise InputError(f"--artifacts are scored on a split they were not fitted on: protocol shape-transfer "
                             f"only, not {protocol}")
        if protocol == "transfer":
            for source in datasets:
                for target in datasets:
                    if source != target:
                        self._transfer(source, target, seeds, probe_size, options, extra)
            return self.rows
        for name in datasets:
            samples = self.data(name, needed=())[0]
            for seed, probe, test in make_splits(protocol, samples, list(seeds), probe_size):
                for det_name in self.detectors:
                    _, labels, views, signals, generator = self._detector_data(name, det_name, options,
                                                                               np.concatenate([probe, test]))
                    self._fit_and_record(det_name, (signals, labels, views, probe), (signals, labels, views, test),
                                         options, f"{name} (seed {seed})", (name, generator, protocol, seed),
                                         extra, probe_size or (100 if protocol == "random-splits" else None))
        return self.rows

    def run_shapes(self, datasets, eval_split: str = "dev", options=None, extra=None, never=(), hold_out=None,
                   artifacts=()):
        """Shape transfer: each detector is fitted on the pooled training parts of all ``datasets`` (the train
        split, and the dev split too when ``eval_split`` is ``test``) and scores every dataset's ``eval_split``
        (rows with ``settings.training = "included"``); then, for each dataset with a training part in turn, fitted
        without any of that dataset and scoring it (``"held-out"``). A dataset with no training part (FaithBench:
        evaluation only), or one named in ``never``, is never trained on: its one row is the included model's,
        marked ``"never"``. ``hold_out`` limits the held-out fits to the datasets it names. Where
        several datasets are RAGTruth generators (``ragtruth:GENERATOR``), a ``ragtruth:pooled`` row scores their
        evaluation parts together with the included model; each generator's held-out row is then leave-one-
        generator-out transfer. ``artifacts`` (shipped names or artifact files) are scored as they are, with no
        fit (:meth:`_shipped`): the figures of the detector users run."""
        from halwatch.data.splits import split_of

        if eval_split not in ("dev", "test"):
            raise ValueError(f"eval_split must be 'dev' or 'test', not {eval_split!r}")
        fit_splits = ("train",) if eval_split == "dev" else ("train", "dev")
        datasets = list(datasets) + [n for n in never if n not in datasets]
        parts = {}
        for name in datasets:
            samples = self.data(name, needed=())[0]
            splits = [split_of(s) for s in samples]
            parts[name] = ([i for i, sp in enumerate(splits) if sp in fit_splits and name not in never],
                           [i for i, sp in enumerate(splits) if sp == eval_split])
        generators = [n for n in datasets if n.startswith("ragtruth:") and parts[n][1]]
        scored = [n for n in datasets if parts[n][1]]
        groups = [[n] for n in scored] + ([generators] if len(generators) > 1 else [])  # a row each
        settings = {"eval": eval_split, **(extra or {}).get("settings", {})}
        for ref in artifacts:
            t0 = time.perf_counter()
            det, trained_on, described = self._shipped(ref, eval_split, scored)
            data = {name: self.data(name, det.request(), parts[name][1]) for name in scored}
            for names in groups:
                self._score_part(det, ref, data, parts, names, t0, {**(extra or {}), "settings": {
                    **settings, "training": "included" if set(names) <= trained_on else "never", "artifact": ref,
                    "fitted_on": "; ".join(described)}})
        for det_name in self.detectors:
            pooled = {name: self._detector_data(name, det_name, options, np.concatenate([fit, ev]).astype(int))
                      for name, (fit, ev) in parts.items()}

            def probe(names):
                rows = [(pooled[n], i) for n in names for i in parts[n][0]]
                return ([d[3][i] for d, i in rows], np.array([d[1][i] for d, i in rows]),
                        [d[2][i] for d, i in rows])

            def score(det, names, t0, training):
                self._score_part(det, det_name, pooled, parts, names, t0,
                                 {**(extra or {}), "settings": {**settings, "training": training}})

            trainable = [n for n in datasets if parts[n][0]]
            t0 = time.perf_counter()
            det = self._fitted(det_name, probe(trainable), options, "every dataset")
            if det is not None:
                for names in groups:
                    score(det, names, t0, "included" if all(parts[n][0] for n in names) else "never")
            for name in trainable:  # a lone trained dataset has nothing else to fit on: no held-out row
                if not parts[name][1] or len(trainable) < 2 or (hold_out is not None and name not in hold_out):
                    continue
                t0 = time.perf_counter()
                det = self._fitted(det_name, probe([n for n in trainable if n != name]), options,
                                   f"every dataset but {name}")
                if det is not None:
                    score(det, [name], t0, "held-out")
        return self.rows

    def _score_part(self, det, det_name, data, parts, names, t0, extra) -> None:
        """One shape-transfer row: ``det`` scores the evaluation parts of the datasets ``names`` (one dataset, or
        several RAGTruth generators pooled as ``ragtruth:pooled``); ``data``: each dataset's :meth:`data`. The row
        carries ``length_auroc``, the AUROC of the answers' length in tokens on the same answers."""
        rows = [(data[n], i) for n in names for i in parts[n][1]]
        signals, views = [d[3][i] for d, i in rows], [d[2][i] for d, i in rows]
        labels = np.array([d[1][i] for d, i in rows])
        scored, spans, thresholds = self.score_answers(det, views, signals)
        length = evaluate(labels, np.zeros(len(labels)), 0.5, [s.n_response for s in signals])["auroc"]
        self._record(names[0] if len(names) == 1 else "ragtruth:pooled", data[names[0]][4], "shape-transfer", 0,
                     det_name, labels, scored, thresholds, time.perf_counter() - t0,
                     {**extra, **spans, "length_auroc": length},  # the confound beside every row
                     split=extra["settings"]["eval"])

    def _shipped(self, ref: str, eval_split: str, scored):
        """A fitted artifact (shipped name or file) loaded for this bench's scorer, the datasets it was trained on
        and the texts that say so: what ``halwatch fit --datasets`` records (``fitted_on.data``,
        :func:`halwatch.data.splits.describe_fit_data`) and, for the parts of a routed artifact put in later by
        ``halwatch fit --into``, each such part's ``fitted_on.parts[task].data``. (The datasets of a part that was
        replaced stay named in ``fitted_on.data``: still refused, and marked as trained on.)
        Refused, in one line, where it was fitted on the ``eval_split`` of a dataset in ``scored`` (the datasets it
        never saw may be scored on any split: the shipped default on the dev part of BUMP, where choices for it are
        made) or does not say on which split."""
        from halwatch.data.splits import fit_data_of
        from halwatch.detectors import load_detector, read_artifact

        artifact = read_artifact(ref)
        fitted_on = artifact.get("fitted_on", {})
        # the whole fit's data, and that of each part put in later (`halwatch fit --into`)
        described = [fitted_on.get("data", "")] + [row["data"] for row in (fitted_on.get("parts") or {}).values()
                                                   if "data" in row]
        trained_on = set()
        for text in described:
            found = fit_data_of(text)
            if found is None:
                raise InputError(f"artifact {ref!r} does not say which datasets and split it was fitted on (fitted_"
                                 f"on data {text!r}): the bench cannot tell whether it would score its own training "
                                 f"answers; fit it with `halwatch fit --datasets ... --split ...`")
            names, split = found
            own = sorted(set(names) & set(scored))
            if eval_split in split and own:
                raise InputError(f"artifact {ref!r} was fitted on the {'+'.join(split)} split of {', '.join(own)}"
                                 f": scoring it on the {eval_split} split would read its own training answers")
            trained_on |= names
        return load_detector(artifact, scorer=self.scorer), trained_on, described

    def run_mapped(self, source_scorer, datasets, seeds=(0, 1, 2, 3, 4), probe_size=None):
        """Cross-model transfer of Lookback Lens (section 4) under the official split: per seed, the detector is
        fitted with ``source_scorer`` on the probe, a linear map from this bench's scoring model's heads to the
        source's is fitted on the same probe answers (no labels), and the mapped detector scores the test split
        with this bench's model. Rows are named ``lookback-lens<-SOURCE``."""
        from halwatch.detectors.attention import LookbackLens

        source = Bench(source_scorer, ["lookback-lens"], progress=self.progress)
        name_from = f"lookback-lens<-{source_scorer.model.name}"
        for name in datasets:
            samples = self.data(name, needed=())[0]
            for seed, probe, test in make_splits("ragtruth-official", samples, list(seeds), probe_size):
                _, labels, views, signals, generator = self.data(name, needed=np.concatenate([probe, test]))
                _, s_labels, s_views, s_signals, _ = source.data(name, needed=probe)
                t0 = time.perf_counter()
                fitted = LookbackLens(scorer=source_scorer).fit_signals([s_signals[i] for i in probe],
                                                                         s_labels[probe], [s_views[i] for i in probe])
                mapped = LookbackLens.mapped_from(fitted, self.scorer, [samples[i] for i in probe])
                scored, spans, thresholds = self.score_answers(mapped, [views[i] for i in test],
                                                               [signals[i] for i in test])
                self._record(name, generator, "ragtruth-official", seed, name_from, labels[test], scored,
                             thresholds, time.perf_counter() - t0, spans, probe_size=probe_size)
        return self.rows

    def _transfer(self, source, target, seeds, probe_size, options, extra):
        """Fit on the source dataset (its train split where it has one), evaluate on the target (its test split
        where it has one): TOHA Figure 3c, Lookback Lens transfer."""
        s_samples, s_labels = self.data(source, needed=())[:2]
        t_samples = self.data(target, needed=())[0]
        s_pool = np.array([i for i, s in enumerate(s_samples) if s.meta.get("split", "train") == "train"])
        t_test = np.array([i for i, s in enumerate(t_samples) if s.meta.get("split", "test") == "test"])
        for seed in seeds:
            probe = subset(s_pool, s_labels, probe_size, seed)
            for det_name in self.detectors:
                _, _, s_views, s_signals, _ = self._detector_data(source, det_name, options, probe)
                _, t_labels, t_views, t_signals, generator = self._detector_data(target, det_name, options, t_test)
                self._fit_and_record(det_name, (s_signals, s_labels, s_views, probe),
                                     (t_signals, t_labels, t_views, t_test), options, f"{source} (seed {seed})",
                                     (f"{source}->{target}", generator, "transfer", seed), extra, probe_size)


def save_results(out_dir, rows, predictions) -> None:
    """Merge rows into ``results.json`` and predictions into ``predictions.jsonl`` (a rerun replaces the rows of
    the same dataset, detector, protocol, seed, input mode and scoring model, whatever its precision); both written
    atomically."""
    import json
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    def key(r):
        return (r["dataset"], r["detector"], r["protocol"], r["seed"], r["input_mode"], r.get("scoring_model"),
                r.get("probe_size"), json.dumps(r.get("settings", {}), sort_keys=True))

    for name, new in (("results.json", rows), ("predictions.jsonl", predictions)):
        path = out / name
        old = []
        if path.exists():
            text = path.read_text()
            old = json.loads(text) if name.endswith(".json") else [json.loads(x) for x in text.splitlines() if x]
        fresh = {key(r) for r in new}
        merged = [r for r in old if key(r) not in fresh] + list(new)
        with replaced(path) as f:
            if name.endswith(".json"):
                json.dump(merged, f, indent=1)
            else:
                f.writelines(json.dumps(r) + "\n" for r in merged)
