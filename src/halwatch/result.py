"""The one shape of a verdict: what ``halwatch score`` prints as a line, what ``POST /v1/score`` returns and what
:meth:`halwatch.Checker.check` gives a Python user."""

from __future__ import annotations

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

    def to_dict(self) -> dict:
        """The result as ``halwatch score`` writes it: every field, less ``ood`` and ``task`` where there are
        none."""
        return self.model_dump(exclude_none=True)
