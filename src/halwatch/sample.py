"""The unit of work: one prompt and one response, with optional label and gold spans.

A sample is built either from a ready ``prompt`` or from a ``context`` (with a ``question`` where the task has one)
rendered by the template of its ``task`` (:data:`TEMPLATES`): question answering, summarisation, a dialogue reply or
a report written from data. The character range of the context inside the prompt is kept (``context_span``) so that
a prompt that is too long for the scoring model can be cut inside the context (from its left end) while the
instructions and the question stay intact.
"""

from __future__ import annotations

import hashlib
import re
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

#: Templates of the other tasks, in the style of :data:`QA_TEMPLATE` (instruction, context, then the question where
#: there is one, then a one-word answer cue). halwatch's own, so that an answer with no question is scored as it is.
SUMMARY_TEMPLATE = (
    "Summarize the following text. Note that your summary should be strictly based on the given text.\n"
    "Text: {context}\n"
    "Summary:"
)
QUERY_SUMMARY_TEMPLATE = (
    "Summarize the following text to answer the query. Note that your summary should be strictly based on the "
    "given text.\n"
    "Text: {context}\n"
    "Query: {question}\n"
    "Summary:"
)
DIALOGUE_TEMPLATE = (
    "Reply to the last turn of the conversation. Note that your reply should be strictly based on the given "
    "knowledge.\n"
    "Knowledge: {context}\n"
    "Last turn: {question}\n"
    "Reply:"
)
OPEN_DIALOGUE_TEMPLATE = (
    "Say something about the given knowledge. Note that what you say should be strictly based on it.\n"
    "Knowledge: {context}\n"
    "Reply:"
)
DATA2TEXT_TEMPLATE = (
    "Write a report of the following data. Note that your report should be strictly based on the given data.\n"
    "Data: {context}\n"
    "Report:"
)

#: ``task -> (template with a question, template without one)``; ``None``: the task needs that part.
TEMPLATES = {
    "qa": (QA_TEMPLATE, None),
    "summary": (QUERY_SUMMARY_TEMPLATE, SUMMARY_TEMPLATE),
    "dialogue": (DIALOGUE_TEMPLATE, OPEN_DIALOGUE_TEMPLATE),
    "data2text": (None, DATA2TEXT_TEMPLATE),
}
TASKS = tuple(TEMPLATES)

#: White space, as Python's ``str.strip`` and ``str.isspace`` read it: a text of these alone is empty.
WHITE_SPACE = "".join(c for c in map(chr, range(0x110000)) if c.isspace())
#: A regular expression that a text matches when it holds a character that is not :data:`WHITE_SPACE`, written as an
#: explicit character class so that JSON Schema (ECMA-262), Python and Rust engines read it alike: a published
#: schema's ``\S`` would let through U+0085, which ECMA-262 does not count as space and Python does.
NON_BLANK = "[^" + "".join(f"\\u{ord(c):04x}" for c in WHITE_SPACE) + "]"


def is_blank(text: str) -> bool:
    """True when ``text`` is empty or :data:`WHITE_SPACE` only."""
    return not text.strip()


#: What asks for a summary: a verb that means "summarise" (not a third person's "sums up"), a summary-like noun that
#: a request asks for, or such a noun "of the text" (of the article, of the above ...). Checked against every question
#: of RAGTruth, SQuAD, BEGIN and FaithDial (none of them is read as a summary request: tests/test_task.py) and on
#: requests written apart from these words.
_SUMMARY_VERB = (r"summari[sz](?:e|es|ed|ing)|sum\s+(?:\w+\s+){0,2}?up|tl;?\s?dr|boil\s+(?:\w+\s+){0,3}?down|"
                 r"in\s+a\s+nutshell|recap")
_SUMMARY_NOUN = (r"summary|summaries|synopsis|overview|abstract|digest|gist|recap|key\s+(?:points|takeaways|ideas)|"
                 r"main\s+(?:points|ideas|takeaways)|takeaways|highlights")
_REQUEST = (r"write|give|provide|produce|create|generate|make|draft|compose|prepare|need|want|list|outline|offer|"
            r"share|condense|reduce|turn|distil+|extract|can\s+you|could\s+you|please")
_TEXT = (r"text|article|passages?|document|story|report|conversation|dialog(?:ue)?|meeting|transcript|context|content|"
         r"email|thread|paper|chapter|book|post|news|above|following|below|it|this|that")
SUMMARY_REQUEST = re.compile(rf"\b(?:{_SUMMARY_VERB})\b|\b(?:{_REQUEST})\b[^.?!]*?\b(?:{_SUMMARY_NOUN})\b|"
                             rf"\b(?:{_SUMMARY_NOUN})\s+of\s+(?:the\s+|this\s+|that\s+)?(?:\w+\s+)?(?:{_TEXT})\b",
                             re.IGNORECASE)


def asks_for_summary(instruction: str | None) -> bool:
    """Whether a question is an instruction to summarise the context ("Summarize the article.", "Write a short
    summary of the text above.", "TL;DR?"): :data:`SUMMARY_REQUEST`."""
    return bool(instruction) and SUMMARY_REQUEST.search(instruction) is not None


def default_task(question: str | None) -> str:
    """The task of a record that names none: a summary without a question or with one that asks for a summary
    (:func:`asks_for_summary`: it is then the summary's query), else question answering."""
    return "summary" if not question or asks_for_summary(question) else "qa"


def task_of(sample: "Sample | None") -> str | None:
    """The task an answer is judged as (:class:`halwatch.detectors.routed.Routed` picks its part by it): the
    sample's ``task``; else, for a context rendered through a template, that template's task (:func:`default_task`);
    else, for a prompt given as it is with its context marked, a summary where the words around the context ask for
    one (:func:`asks_for_summary`); else question answering (RAGTruth's prompts, a chat's). ``None`` for no sample (a
    view made from token ids alone)."""
    if sample is None:
        return None
    if sample.task is not None:
        return sample.task
    if sample.rendered:
        return default_task(sample.question)
    if sample.context_span is not None:  # a prompt given as it is: its words around the context are its instruction
        start, end = sample.context_span
        return "summary" if asks_for_summary(sample.prompt[:start] + "\n" + sample.prompt[end:]) else "qa"
    return "qa"


def render(task: str, context: str, question: str | None = None) -> tuple[str, tuple[int, int]]:
    """``(prompt, context_span)``: ``context`` and ``question`` in the template of ``task``."""
    if task not in TEMPLATES:
        raise InputError(f"unknown task {task!r}: choose one of {', '.join(TASKS)}")
    with_question, without = TEMPLATES[task]
    template = with_question if question else without
    if template is None:
        raise InputError(f"task {task!r} needs a question" if question is None or not question
                         else f"task {task!r} takes no question")
    head, _, tail = template.partition("{context}")
    prompt = head + context + (tail.format(question=question) if question else tail)
    return prompt, (len(head), len(head) + len(context))


@dataclass
class Sample:
    """A response to score, and the prompt it answered.

    ``label`` is 1 for a hallucinated response and 0 for a grounded one (``None``: unknown). ``spans`` are gold
    hallucinated spans as dicts with ``start``/``end`` character offsets into ``response`` (``end`` exclusive).
    ``context_span`` is the ``(start, end)`` character range of the retrieved context inside ``prompt``. ``task``
    (:data:`TASKS`) picks the template a ``context`` is rendered with when no ``prompt`` is given; by default
    question answering when there is a question, else a summary.
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
    task: str | None = None
    #: whether ``prompt`` was rendered from ``context`` (and ``question``) through a task's template
    rendered: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.task is not None and self.task not in TEMPLATES:
            raise InputError(f"unknown task {self.task!r}: choose one of {', '.join(TASKS)}", self.where)
        if not self.prompt and isinstance(self.context, str) and self.context.strip():
            if self.question is not None and not isinstance(self.question, str):
                raise InputError("field 'question' must be a string", self.where)
            try:
                self.prompt, self.context_span = render(self.task or default_task(self.question), self.context,
                                                        self.question or None)
                self.rendered = True
            except InputError as exc:
                raise InputError(exc.problem, self.where) from None
        elif self.context_span is None and self.context and self.context in self.prompt:
            start = self.prompt.index(self.context)
            self.context_span = (start, start + len(self.context))
        if self.id is not None:
            self.id = str(self.id)
        self.validate()

    @property
    def source(self) -> str:
        """The source document this answer was written from, so that folds and splits keep the answers to one
        source together: ``meta`` ``source_id`` (RAGTruth, the shared sets), else ``title`` (SQuAD), else a hash of
        the context (of the prompt where no context is marked)."""
        for key in ("source_id", "title"):
            if self.meta.get(key) is not None:
                return f"{key}:{self.meta[key]}"
        return "text:" + hashlib.sha256(self.context_text.encode("utf-8")).hexdigest()[:16]

    @property
    def context_text(self) -> str:
        """The whole context: ``context``, else the ``context_span`` of the prompt, else the whole prompt."""
        if self.context is not None:
            return self.context
        if self.context_span is not None:
            return self.prompt[self.context_span[0]:self.context_span[1]]
        return self.prompt

    @property
    def where(self) -> str | None:
        return f"id={self.id}" if self.id is not None else None

    def validate(self) -> None:
        """Raise :class:`InputError` naming the record when the sample cannot be scored."""
        if not isinstance(self.response, str):
            raise InputError("field 'response' must be a string", self.where)
        if is_blank(self.response):
            raise InputError("empty response", self.where)
        if not isinstance(self.prompt, str) or is_blank(self.prompt):
            raise InputError("empty prompt (give 'prompt', or a non-empty 'context')", self.where)
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
        if self.context is not None and self.context_span is not None and \
                self.prompt[self.context_span[0]:self.context_span[1]] == self.context and self.rendered:
            out["context"] = self.context
            if self.question:
                out["question"] = self.question
            if self.task:
                out["task"] = self.task
        else:
            out["prompt"] = self.prompt
            if self.context_span is not None:
                out["context_span"] = list(self.context_span)
            if self.task:
                out["task"] = self.task
        out["response"] = self.response
        if self.label is not None:
            out["label"] = self.label
        if self.spans:
            out["spans"] = self.spans
        if self.meta:
            out["meta"] = self.meta
        return out
