"""SQuAD 2.0 JSON (official format): questions with their context, gold answers and answerability."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from halwatch.data import data_root
from halwatch.errors import InputError
from halwatch.sample import Sample

DEFAULT_FILE = "cs224n-dev-v2.0.json.gz"


@dataclass
class SquadQuestion:
    id: str
    title: str
    context: str
    question: str
    answers: list[str]
    is_impossible: bool
    answer_starts: tuple[int, ...] = ()  # character offset of each gold answer in the context
    plausible: tuple[tuple[str, int], ...] = ()  # an unanswerable question's plausible answers (text, offset)

    def sample(self, response: str, **kwargs) -> Sample:
        """A sample answering this question from its context (rendered with the QA template)."""
        return Sample(context=self.context, question=self.question, response=response, id=self.id,
                      meta={"title": self.title, "answers": self.answers, "is_impossible": self.is_impossible},
                      **kwargs)


def read_squad(path: str | Path | None = None, titles=None) -> list[SquadQuestion]:
    """All questions of a SQuAD 2.0 file (``.json`` or ``.json.gz``), optionally only those of some article titles."""
    path = Path(path) if path else data_root() / "squad" / DEFAULT_FILE
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", str(path)) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"not a SQuAD JSON file ({exc})", str(path)) from None
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise InputError("not a SQuAD 2.0 file: no top-level 'data' list", str(path))
    wanted = {titles} if isinstance(titles, str) else set(titles) if titles else None
    out = []
    for article in data["data"]:
        if wanted and article["title"] not in wanted:
            continue
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                out.append(SquadQuestion(
                    id=str(qa["id"]), title=article["title"], context=para["context"], question=qa["question"],
                    answers=[a["text"] for a in qa.get("answers", [])], is_impossible=bool(qa.get("is_impossible")),
                    answer_starts=tuple(int(a.get("answer_start", -1)) for a in qa.get("answers", [])),
                    plausible=tuple((a["text"], int(a.get("answer_start", -1)))
                                    for a in qa.get("plausible_answers", [])),
                ))
    if wanted and not out:
        raise InputError(f"no article titled {sorted(wanted)}", str(path))
    return out
