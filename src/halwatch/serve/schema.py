"""The request and response bodies of ``halwatch serve``'s scoring routes (the score result itself is
:class:`halwatch.result.Result`), and the parsing of a /v1/score body into items."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from halwatch.errors import InputError
from halwatch.sample import NON_BLANK
from halwatch.serve.common import ApiError

#: A string with at least one character that is not white space: the same rule as the library's
#: (:data:`halwatch.sample.NON_BLANK`), so that the published schema and the server's own check agree.
Text = Annotated[str, Field(pattern=NON_BLANK)]


def _given(*fields: str) -> dict:
    """JSON Schema: ``fields`` are present and not null."""
    return {"required": list(fields), "properties": {f: {"not": {"type": "null"}} for f in fields}}


_TASK_RULES = [
    # the qa template needs a question; data2text's takes none (a given ``prompt`` makes the task moot)
    {"if": {"properties": {"task": {"const": "qa"}}, "required": ["task"], "not": _given("prompt")},
     "then": {"required": ["question"], "properties": {"question": {"type": "string", "minLength": 1}}}},
    {"if": {"properties": {"task": {"const": "data2text"}}, "required": ["task"], "not": _given("prompt")},
     "then": {"properties": {"question": {"anyOf": [{"type": "null"}, {"maxLength": 0}]}}}},
]


class ScoreItem(BaseModel):
    """One answer to score: ``response`` and either ``prompt`` or ``context`` / ``contexts`` (not both), with
    ``question`` where the task has one. Absent and null fields are the same."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "anyOf": [_given("prompt"), _given("context"), _given("contexts")],
        "not": _given("context", "contexts"), "allOf": _TASK_RULES})
    id: str | int | None = Field(None, description="returned with the result (default: the item's index)")
    context: Text | None = Field(None, description="the retrieved context the answer should rest on (beside a "
                                                   "prompt: the part of it that is the context)")
    contexts: list[Text] | None = Field(None, min_length=1, description="several passages, joined by blank lines")
    question: str | None = Field(None, description="the question (task qa; optional for summary and dialogue)")
    task: Literal["qa", "summary", "dialogue", "data2text"] | None = Field(
        None, description="the template the context is rendered with (default: qa with a question, else summary; "
                          "summary too where the question asks for one)")
    prompt: Text | None = Field(None, description="the whole prompt, instead of context and question")
    response: Text = Field(description="the answer to score")
    detector: str | None = Field(None, description="a loaded detector (GET /v1/detectors; default: the server's "
                                                   "default)")
    min_span_confidence: float | None = Field(
        None, ge=0, le=1, description="leave out spans whose confidence is below this (default: the server's, set by "
                                      "serve --min-span-confidence, else 0: every span)")
    evidence: Literal["attention"] | None = Field(
        None, description="'attention': give each response sentence its support and its sources in the context, "
                          "from the same pass (a few percent more time); default: none. (The exact 'relevance' "
                          "mode, seconds per answer, is the library's and the command's, not the service's.)")

    def sample(self, index: int):
        from halwatch.sample import Sample

        if self.context is not None and self.contexts is not None:
            raise InputError("give context or contexts, not both")
        context = "\n\n".join(self.contexts) if self.contexts is not None else self.context
        if not self.prompt and context is None:
            raise InputError("give prompt, or context (or contexts) with question where the task has one")
        return Sample(response=self.response, prompt=self.prompt or "", context=context, question=self.question,
                      task=self.task, id=str(self.id) if self.id is not None else str(index))


EXAMPLE = {"id": "1", "context": "Insulin is a peptide hormone produced by beta cells of the pancreatic islets.",
           "question": "Which cells produce insulin?",
           "response": "Insulin is produced by red blood cells in the bone marrow."}


def parse_items(body) -> list[ScoreItem]:
    """The items of a /v1/score body (an object or a list of objects), or a 422 naming the item and field."""
    from pydantic import ValidationError

    many = isinstance(body, list)
    raw = body if many else [body]
    if not raw:
        raise ApiError(422, "an empty list: give at least one item", "no_items")
    items = []
    for i, item in enumerate(raw):
        try:
            items.append(ScoreItem.model_validate(item))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            name = f"item {i}" if many else "the item"
            param = f"[{i}].{where}" if many else where
            problem = (f"empty {where} (white space only)" if first["type"] == "string_pattern_mismatch"
                       else f"{where or 'body'}: {first['msg']}")
            raise ApiError(422, f"{name}: {problem}", "invalid_item", param) from None
    return items


class DetectorInfo(BaseModel):
    """A loaded detector: its name, method, threshold, scoring model and what it was fitted on."""

    model_config = ConfigDict(extra="allow")
    name: str
    method: str
    default: bool
    threshold: float | None = None
    thresholds: dict[str, float] | None = Field(None, description="a routed detector's threshold per task (its "
                                                                  "`threshold` is null)")
    prior: float | None = Field(None, description="the share of hallucinated answers its probabilities assume "
                                                 "(`halwatch calibrate --prior` restates it)")
    priors: dict[str, float] | None = Field(None, description="a routed detector's `prior` per task")
    dtype: str | None = Field(None, description="the precision of the signals it was fitted on")
    scored_in: str | None = Field(None, description="the precision this service scores it in (`--dtype`; where it "
                                                    "differs from `dtype`, scores differ slightly from the fit's)")


class DetectorList(BaseModel):
    default: str
    detectors: list[DetectorInfo]


class WatchVerdict(BaseModel):
    """HalMit's verdict on a query (Algorithm 1): ``hallucination``, the ``case`` that decided it, the neighbours."""

    model_config = ConfigDict(extra="allow")
    hallucination: bool


class WatchQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: str = Field(min_length=1, max_length=4000)
