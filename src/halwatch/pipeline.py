"""The one scoring path: a fitted detector on its scorer, from samples to :class:`~halwatch.result.Result` s.

samples -> token views (one per answer, or the windows of a long context) -> one batched forward pass asking for
every signal the detectors need -> each answer's verdict. ``halwatch score``, the service's worker, the Ray actors,
``halwatch bench speed`` and :class:`halwatch.Checker` all score through :class:`Pipeline` (the service through
:func:`score_jobs`, which lets several detectors on one scorer share one pass).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from halwatch.errors import InputError
from halwatch.result import Result
from halwatch.sample import Sample
from halwatch.timing import timed
from halwatch.tokens import TokenView, runs_within

#: Views (answers, or windows of a long context) whose signals :meth:`Pipeline.stream` holds at once: an answer's
#: signals and features take megabytes (1,200 cached RAGTruth answers held whole: 3.4 GB resident, 1.4 GB in chunks),
#: so a file is scored and written a chunk at a time and memory stays flat however long it is.
CHUNK = 256


class Pipeline:
    """A fitted ``detector`` and the scorer it reads (its own: :meth:`Detector.get_scorer`)."""

    def __init__(self, detector):
        self.detector = detector
        self.scorer = detector.get_scorer()

    def encode(self, samples: list[Sample], keep_errors: bool = False) -> list:
        """Each sample's views (one, or the windows of its long context); a sample that cannot be scored raises its
        :class:`~halwatch.errors.InputError`, or with ``keep_errors`` gets it in its place."""
        return self.scorer.encode_many(samples, keep_errors=keep_errors)

    def score(self, answers: list[list[TokenView]], min_span_confidence: float | None = None, bar=None,
              batch_size=..., evidence: str | None = None) -> list[Result]:
        """The results of ``answers`` (each its views, as :meth:`encode` gives them) from one batched pass.
        ``min_span_confidence``: leave out weaker spans (default: the detector's own). ``bar``: a progress bar
        advanced by every view. ``batch_size``: answers per forward pass, where not the scorer's. ``evidence``:
        each answer sentence's sources in the context, by ``attention`` or ``relevance``
        (:mod:`halwatch.evidence`); ``None``: none."""
        return score_jobs([Job(self, views, min_span_confidence, evidence) for views in answers], bar=bar,
                          batch_size=batch_size)

    def request(self, evidence: str | None = None):
        """What the pass must return for the detector's verdicts, and for ``evidence`` where asked."""
        request = self.detector.request()
        if evidence is None:
            return request
        from halwatch import evidence as evidence_lib

        return request.merge(evidence_lib.request(self.scorer.model, evidence))

    def stream(self, answers: list[list[TokenView]], progress: bool = False, min_span_confidence=None,
               chunk: int | None = None, evidence: str | None = None) -> Iterator[Result]:
        """:meth:`score` of ``answers`` in order, :data:`CHUNK` views at a time (an answer's windows in one chunk),
        under one progress bar: memory stays flat however many there are."""
        from halwatch.progress import progress as progress_bar

        with progress_bar(total=sum(len(a) for a in answers), disable=not progress, desc="forward",
                          unit="sample") as bar:
            for run in runs_within([len(a) for a in answers], chunk or CHUNK):
                yield from self.score(answers[run.start:run.stop], min_span_confidence, bar=bar, evidence=evidence)

    @timed("detector: scores and spans")
    def results(self, views: list[TokenView], signals: list, min_span_confidence: float | None = None,
                evidence: str | None = None) -> list[Result]:
        """The results of answers whose ``views`` (an answer's windows together) and ``signals`` are at hand."""
        found = self.detector.verdicts(views, signals, min_span_confidence, sentences=evidence is not None)
        if evidence is not None:
            from halwatch import evidence as evidence_lib

            evidence_lib.attach(found, views, signals, self.scorer.model.tokenizer, evidence)
        return [Result(**v) for v in found]


@dataclass
class Job:
    """One answer for :func:`score_jobs`: the pipeline that judges it, its views, its span confidence floor, and
    how its evidence is found (``None``: none)."""

    pipeline: Pipeline
    views: list[TokenView]
    min_span_confidence: float | None = None
    evidence: str | None = None


def score_jobs(jobs: list[Job], bar=None, batch_size=...) -> list[Result]:
    """Each job's result: one padded forward pass per scorer over the answers of every pipeline that shares it,
    asking for the merged signals of their detectors; then each pipeline's verdicts on its own answers (together,
    per span confidence floor). ``batch_size``: answers per forward pass, where not the scorer's."""
    results: list[Result | None] = [None] * len(jobs)
    by_scorer: dict[int, list[int]] = {}
    for i, job in enumerate(jobs):
        by_scorer.setdefault(id(job.pipeline.scorer), []).append(i)
    for indices in by_scorer.values():
        scorer = jobs[indices[0]].pipeline.scorer
        asked = {(id(jobs[i].pipeline), jobs[i].evidence): jobs[i] for i in indices}  # each request once
        first, *others = [job.pipeline.request(job.evidence) for job in asked.values()]
        request = first.merge(*others) if others else first
        views = [v for i in indices for v in jobs[i].views]
        signals = iter(scorer.signals([v.sample for v in views], request, views=views, bar=bar,
                                      batch_size=batch_size))
        mine = {i: [next(signals) for _ in jobs[i].views] for i in indices}
        together: dict[tuple, list[int]] = {}
        for i in indices:
            together.setdefault((id(jobs[i].pipeline), jobs[i].min_span_confidence, jobs[i].evidence), []).append(i)
        for group in together.values():
            job = jobs[group[0]]
            found = job.pipeline.results([v for i in group for v in jobs[i].views],
                                         [s for i in group for s in mine[i]], job.min_span_confidence, job.evidence)
            for i, result in zip(group, found):
                results[i] = result
    return results


def encoded(pipeline: Pipeline, samples: list[Sample], skip_invalid: bool, on_skip=None
            ) -> tuple[list[Sample], list[list[TokenView]]]:
    """The samples that can be scored and their views: with ``skip_invalid``, the others are reported through
    ``on_skip(error)`` and left out; without, the first raises its :class:`~halwatch.errors.InputError`. Raises when
    none is left."""
    kept, answers = [], []
    for sample, found in zip(samples, pipeline.encode(samples, keep_errors=skip_invalid)):
        if isinstance(found, InputError):
            if on_skip is not None:
                on_skip(found)
            continue
        kept.append(sample)
        answers.append(found)
    if not kept:
        raise InputError("no usable records")
    return kept, answers
