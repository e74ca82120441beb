"""The unit of work: one prompt and one response, with optional label and gold spans.

A sample is built either from a ready ``prompt`` or from ``context`` + ``question`` rendered by
:data:`QA_TEMPLATE`. The character range of the context inside the prompt is kept (``context_span``) so that a prompt
that is too long for the scoring model can be cut inside the context (from its left end) while the instructions and
the question stay intact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from halwatch.errors import InputError

#: Template for ``context`` + ``question`` samples: the SQuAD prompt of TOHA (Bazarova et al.), Table 15.
#: The context comes before the question, so cutting the context from the left never drops the question.
QA_TEMPLATE = (
    "Given the context, answer the question in a brief but complete sentence. Note that your answer should be "
    "strictly based on the given context. In case the context does not contain the necessary information to answer "
    'the question, please reply with "Unable to answer based on given context".\n'
    "Context: {context}\n"
    "Question: {question}\n"
    "Answer:"
)


@dataclass
class Sample:
    """A response to score, and the prompt it answered.

    ``label`` is 1 for a hallucinated response and 0 for a grounded one (``None``: unknown). ``spans`` are gold
    hallucinated spans as dicts with ``start``/``end`` character offsets into ``response`` (``end`` exclusive).
    ``context_span`` is the ``(start, end)`` character range of the retrieved context inside ``prompt``.
    """

    response: str
    prompt: str = ""
    context: str | None = None
    question: str | None = None
    id: str | None = None
    label: int | None = None
    spans: list[dict[str, Any]] = field(default_factory=list)
    context_span: tuple[int, int] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not self.prompt and self.context is not None and self.question is not None:
            head, _, tail = QA_TEMPLATE.partition("{context}")
            self.prompt = head + self.context + tail.format(question=self.question)
            self.context_span = (len(head), len(head) + len(self.context))
        elif self.context_span is None and self.context and self.context in self.prompt:
            start = self.prompt.index(self.context)
            self.context_span = (start, start + len(self.context))
        if self.id is not None:
            self.id = str(self.id)
        self.validate()

    @property
    def where(self) -> str | None:
        return f"id={self.id}" if self.id is not None else None

    def validate(self) -> None:
        """Raise :class:`InputError` naming the record when the sample cannot be scored."""
        if not isinstance(self.response, str):
            raise InputError("field 'response' must be a string", self.where)
        if not self.response.strip():
            raise InputError("empty response", self.where)
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise InputError("empty prompt (give 'prompt', or 'context' and 'question')", self.where)
        if self.label not in (None, 0, 1):
            raise InputError(f"label must be 0, 1 or null, got {self.label!r}", self.where)
        for span in self.spans:
            start, end = span.get("start"), span.get("end")
            if not isinstance(start, int) or not isinstance(end, int) or isinstance(start, bool):
                raise InputError(f"span {span!r} needs integer 'start' and 'end'", self.where)
            if not 0 <= start < end <= len(self.response):
                raise InputError(
                    f"span [{start}, {end}) is outside the response (length {len(self.response)})", self.where
                )
        if self.context_span is not None:
            start, end = self.context_span
            if not 0 <= start <= end <= len(self.prompt):
                raise InputError(f"context_span {self.context_span} is outside the prompt", self.where)

    def to_dict(self) -> dict[str, Any]:
        """The generic JSONL form (see :mod:`halwatch.data.jsonl`)."""
        out: dict[str, Any] = {"id": self.id}
        if self.context is not None and self.question is not None:
            out.update(context=self.context, question=self.question)
        else:
            out["prompt"] = self.prompt
            if self.context_span is not None:
                out["context_span"] = list(self.context_span)
        out["response"] = self.response
        if self.label is not None:
            out["label"] = self.label
        if self.spans:
            out["spans"] = self.spans
        if self.meta:
            out["meta"] = self.meta
        return out
