"""The one shape of a verdict: what ``halwatch score`` prints as a line, what ``POST /v1/score`` returns and what
:meth:`halwatch.Checker.check` gives a Python user."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

#: Character offsets of spans are Python string indices: Unicode code points.
OFFSET_UNIT = "unicode_code_point"


class Span(BaseModel):
    """Words of the response the detector flags as unsupported: ``response[start:end] == text``."""

    start: int
    end: int
    text: str
    confidence: float = Field(description="the calibrated chance that the span marks unsupported words")


class Distance(BaseModel):
    """How far an answer's inputs lie from the detector's training answers."""

    distance: float
    percentile: float = Field(description="the share of training answers nearer to the training data than this one")
    extrapolated: bool = Field(description="farther than all but 1 % of the training answers")
    weak: bool | None = Field(None, description="the detector (the part of the answer's task) ranks even its own "
                                                "training answers poorly: held-out AUROC below 0.7")
    held_out_auroc: float | None = Field(None, description="the AUROC of the detector's (part's) held-out scores "
                                                           "of its training answers")


class Source(BaseModel):
    """A sentence of the context (``field``: ``context``; ``prompt`` where no context was marked) that an answer
    sentence rests on: ``context[start:end] == text``."""

    start: int
    end: int
    text: str
    weight: float = Field(description="the share of the answer sentence's attention (or relevance) on the context "
                                      "that lands in this sentence")
    field: Literal["context", "prompt"]


class SentenceEvidence(BaseModel):
    """One sentence of the response (``response[start:end] == text``) and the context sentences it rests on."""

    start: int
    end: int
    text: str
    support: float = Field(description="the chance that every word of the sentence is supported, from the "
                                       "detector's token scores (its answer score where it has none)")
    supported: bool = Field(description="false where a flagged span lies in the sentence: then it has no sources")
    sources: list[Source]


class Result(BaseModel):
    """One answer's verdict."""

    id: str
    score: float = Field(description="probability that the response is hallucinated (not supported by its context)")
    hallucinated: bool = Field(description="score >= threshold")
    threshold: float
    spans: list[Span]
    offset_unit: str = OFFSET_UNIT
    detector: str
    scoring_model: str
    input_mode: str
    truncated: int = Field(description="context tokens that no window held (the response is never cut)")
    windows: int = Field(1, description="windows of a context longer than the token cap that the answer was scored "
                                        "against: the most supportive one gives the verdict, and each word's score "
                                        "is its lowest over them")
    ood: Distance | None = None
    task: str | None = Field(None, description="the task whose part of a routed detector judged the answer (its "
                                               "threshold is that part's)")
    evidence: list[SentenceEvidence] | None = Field(None, description="each response sentence's sources in the "
                                                                      "context, where asked (halwatch.evidence)")

    def to_dict(self) -> dict:
        """The result as ``halwatch score`` writes it: every field, less ``ood``, ``task`` and ``evidence`` where
        there are none."""
        return self.model_dump(exclude_none=True)
