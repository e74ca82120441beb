"""halwatch's one face for Python users.

    import halwatch

    hw = halwatch.load()                      # the shipped default on the default scoring model
    result = hw.check(context="...", question="...", response="...")
    result.score, result.hallucinated, result.spans, result.to_dict()
    results = hw.check_many([{"context": ..., "question": ..., "response": ...}, ...])

Every result is a :class:`~halwatch.result.Result`, the same type ``halwatch score`` prints a line of
(:meth:`Result.to_dict`) and ``POST /v1/score`` returns. Bad input raises :class:`~halwatch.errors.InputError` with
the one-line message the command gives; a checker may be called from several threads (one scores at a time).
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path

from halwatch.errors import InputError
from halwatch.pipeline import Pipeline, encoded
from halwatch.result import Result
from halwatch.sample import Sample
from halwatch.tokens import MAX_WINDOWS


class Checker:
    """A fitted detector on its scoring model, ready to judge answers (made by :func:`load`)."""

    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline
        self._lock = threading.Lock()

    @property
    def detector(self) -> str:
        """The detector's method name (``routed`` for the shipped default)."""
        return self.pipeline.detector.name

    @property
    def scoring_model(self) -> str:
        return self.pipeline.scorer.model.name

    def check(self, response: str, context: str | list[str] | None = None, question: str | None = None,
              prompt: str | None = None, task: str | None = None, id: str | None = None,
              min_span_confidence: float | None = None, evidence: str | None = None) -> Result:
        """The verdict on one answer: ``response`` to ``context`` (several passages: a list, joined by blank lines)
        and ``question`` where the task has one, or to a whole ``prompt``. ``task``: ``qa``, ``summary``,
        ``dialogue`` or ``data2text`` (default: qa with a question, summary without one or with one that asks for a
        summary). ``min_span_confidence``: leave out spans below this confidence (default: the detector's).
        ``evidence``: ``attention`` (from the pass, a few percent more time) or ``relevance`` (exact, a backward
        pass per response token) gives each response sentence its sources in the context (``result.evidence``,
        :mod:`halwatch.evidence`)."""
        record = {"id": id, "prompt": prompt, "context": context, "question": question, "task": task,
                  "response": response}
        return self.check_many([{k: v for k, v in record.items() if v is not None}],
                               min_span_confidence=min_span_confidence, evidence=evidence)[0]

    def check_many(self, records: list, batch_size: int | None = ..., progress: bool = False,
                   min_span_confidence: float | None = None, evidence: str | None = None) -> list[Result]:
        """The verdicts on many answers, in order: each a dict of the generic JSONL format (``id``, ``prompt`` or
        ``context`` (a string or a list of passages) with ``question``, ``task``, ``response``; an ``id`` left out
        is the record's index) or a :class:`~halwatch.sample.Sample`. ``batch_size``: answers per forward pass
        (``None``: as many as fit the scorer's token budget; default: the checker's). Every record is checked before
        any is scored: the first bad one raises its :class:`~halwatch.errors.InputError`, naming it. ``evidence``:
        as :meth:`check`."""
        from halwatch.evidence import check_mode

        check_mode(evidence)  # before any answer is scored
        samples = [as_sample(r, i) for i, r in enumerate(records)]
        if not samples:
            return []
        if min_span_confidence is not None:
            from halwatch.detectors.spans import check_confidence

            min_span_confidence = check_confidence(min_span_confidence)
        with self._lock:
            _, answers = encoded(self.pipeline, samples, skip_invalid=False)
            if not progress:
                return self.pipeline.score(answers, min_span_confidence, batch_size=batch_size, evidence=evidence)
            from halwatch.progress import progress as progress_bar

            with progress_bar(total=sum(len(a) for a in answers), desc="forward", unit="sample") as bar:
                return self.pipeline.score(answers, min_span_confidence, bar=bar, batch_size=batch_size,
                                           evidence=evidence)


def as_sample(record, index: int) -> Sample:
    """A record of :meth:`Checker.check_many` as a sample (its id, else its index)."""
    if isinstance(record, Sample):
        if record.id is None:
            record = copy.copy(record)
            record.id = str(index)
        return record
    if not isinstance(record, dict):
        raise InputError(f"expected a dict or a Sample, got {type(record).__name__}", f"record {index}")
    from halwatch.data.jsonl import sample_from_record

    record = record if record.get("id") is not None else {**record, "id": str(index)}
    contexts = record.get("context")
    if isinstance(contexts, (list, tuple)):
        if not contexts or not all(isinstance(c, str) for c in contexts):
            raise InputError("field 'context': a string, or a non-empty list of strings",
                             f"record {index} (id={record['id']})")
        record = {**record, "context": "\n\n".join(contexts)}
    return sample_from_record(record, f"record {index}")


def load(detector: str | Path | dict = "default", model: str | None = None, device: str = "auto",
         dtype: str = "auto", input_mode: str | None = None, max_tokens: int | None = None,
         windows: int = MAX_WINDOWS, batch_size: int | None = None, cache: bool | str | Path = False,
         min_span_confidence: float | None = None) -> Checker:
    """A :class:`Checker`: ``detector`` (a shipped artifact's name, an artifact file or its JSON; default: the shipped
    default) on ``model`` (a registered name, a local Hugging Face folder; default: the artifact's scoring model),
    on ``device`` (``auto``, ``cpu``, ``cuda``, ``mps``) in ``dtype`` (``auto``, ``float32``, ``bfloat16``,
    ``float16``). ``input_mode``, ``max_tokens``: default the artifact's; ``windows``: the most windows a context
    longer than the token cap is scored in; ``batch_size``: answers per forward pass (``None``: by a token budget);
    ``cache``: keep signals on disk (``True``: in ``$HALWATCH_HOME/signals``, or a folder). The scoring model loads
    here, so an unknown one fails at once."""
    from halwatch.detectors import load_detector
    from halwatch.detectors.spans import check_confidence

    floor = None if min_span_confidence is None else check_confidence(min_span_confidence)
    det = load_detector(detector, model=model, device=device, dtype=dtype, input_mode=input_mode,
                        max_tokens=max_tokens, windows=windows, batch_size=batch_size, cache=cache)
    if floor is not None:
        det.min_span_confidence = floor
    checker = Checker(Pipeline(det))
    checker.pipeline.scorer.model  # noqa: B018 - load it now: an unknown or broken model fails here
    return checker
