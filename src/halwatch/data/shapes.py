"""Labelled short answers built from SQuAD 2.0, with labels that follow from the data itself (no judge):

- ``phrase`` / ``sentence`` (grounded, label 0): a gold answer of an answerable question, as the phrase itself or as
  the sentence of the passage that holds it;
- ``phrase-swap`` / ``sentence-swap`` (hallucinated, label 1): the same two answers with the gold answer replaced by
  another value of its kind that the passage does not contain (a number or year moved, a name or phrase taken from a
  question of another article); the replaced words are the gold span. Each swap has its grounded twin;
- ``unanswerable`` (hallucinated, label 1): a plausible answer (SQuAD's ``plausible_answers``) to a question the
  passage cannot answer, the whole answer as the span.

Every sample carries ``meta["title"]`` (its source: folds and splits keep an article together), ``meta["shape"]`` and
``meta["split"]`` (train / dev / test by a hash of the title, :func:`halwatch.data.splits.split_of_source`).
"""

from __future__ import annotations

import random
import re

from halwatch.data.splits import split_of_source
from halwatch.data.squad import SquadQuestion, read_squad
from halwatch.sample import Sample

SHAPES = ("phrase", "sentence", "phrase-swap", "sentence-swap", "unanswerable")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
MAX_SENTENCE_CHARS = 400


def sentence_around(context: str, start: int, end: int) -> tuple[int, int] | None:
    """The character range of the passage's sentence holding ``[start, end)`` (cut after ``.``, ``!`` or ``?``
    followed by white space and an upper-case letter, digit or quote), or ``None`` when it spans two sentences."""
    cuts = [0] + [m.end() for m in re.finditer(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])", context)] + [len(context) + 1]
    for a, b in zip(cuts, cuts[1:]):
        if a <= start and end <= b - 1:
            return a, len(context[a:b - 1].rstrip()) + a
    return None


def kind_of(answer: str) -> str:
    """``number`` (holds a digit), ``name`` (every word of three letters or more capitalised) or ``phrase``."""
    if NUMBER.search(answer):
        return "number"
    long_words = [w for w in re.findall(r"[^\W\d_]+", answer) if len(w) >= 3]
    if long_words and all(w[0].isupper() for w in long_words):
        return "name"
    return "phrase"


def _moved_number(text: str, rng: random.Random) -> str:
    """``text`` with one number in it changed: a year by 2-40 years, another number by a factor or an offset."""
    found = list(NUMBER.finditer(text))
    m = rng.choice(found)
    raw = m.group(0).replace(",", "")
    value = float(raw)
    if re.fullmatch(r"1[0-9]{3}|20[0-9]{2}", raw):
        new = int(value) + rng.choice([-1, 1]) * rng.randint(2, 40)
    elif "." in raw:
        new = round(value * rng.choice([0.5, 1.5, 2.0, 3.0]) + rng.randint(1, 9) / 10, 1)
    elif value < 20:
        new = int(value) + rng.randint(2, 9)
    else:
        new = int(value * rng.choice([0.5, 2, 3]) + rng.randint(1, 9))
    new_text = f"{new:,}" if "," in m.group(0) else str(new)
    return text[:m.start()] + new_text + text[m.end():]


def _supported(text: str, context: str) -> bool:
    """Whether ``text`` or any number in it occurs in the context (case-blind): then it is no swap."""
    low = context.lower()
    return text.lower() in low or any(n.group(0) in context for n in NUMBER.finditer(text))


def swap_for(q: SquadQuestion, answer: str, pool: dict, rng: random.Random, tries: int = 30) -> str | None:
    """A replacement for ``answer`` of its kind that the passage does not hold, or ``None``. ``pool``: ``kind ->
    [(title, answer)]`` of every question's first gold answer."""
    kind = kind_of(answer)
    n_words = len(answer.split())
    for _ in range(tries):
        if kind == "number":
            new = _moved_number(answer, rng)
        else:
            title, new = rng.choice(pool[kind])
            if title == q.title or abs(len(new.split()) - n_words) > 1:
                continue
        if new.strip() and new.lower() != answer.lower() and not _supported(new, q.context):
            return new
    return None


def build_squad_shapes(n_questions: int = 400, n_unanswerable: int = 200, seed: int = 0,
                       questions: list[SquadQuestion] | None = None) -> list[Sample]:
    """``n_questions`` answerable questions, each as the four samples ``phrase``, ``sentence`` and their swaps
    (fewer where no sentence or no swap can be made), and ``n_unanswerable`` plausible answers to unanswerable
    questions, drawn with ``seed``."""
    questions = questions if questions is not None else read_squad()
    rng = random.Random(seed)
    pool: dict[str, list] = {"name": [], "phrase": []}
    for q in questions:
        if q.answers and kind_of(q.answers[0]) in pool:
            pool[kind_of(q.answers[0])].append((q.title, q.answers[0].strip()))
    answerable = [q for q in questions if not q.is_impossible and q.answers and q.answer_starts]
    unanswerable = [q for q in questions if q.is_impossible and q.plausible]
    samples: list[Sample] = []

    def add(q, shape, response, label, spans):
        samples.append(Sample(context=q.context, question=q.question, response=response, id=f"{q.id}-{shape}",
                              label=label, spans=spans,
                              meta={"title": q.title, "shape": shape, "question_id": q.id,
                                    "split": split_of_source(f"squad/{q.title}"), "dataset": "squad-shapes"}))

    for q in rng.sample(answerable, min(n_questions, len(answerable))):
        answer, start = q.answers[0].strip(), q.answer_starts[0]
        start += q.answers[0].index(answer) if answer else 0
        if not answer or q.context[start:start + len(answer)] != answer:
            continue
        swap = swap_for(q, answer, pool, rng)
        add(q, "phrase", answer, 0, [])
        if swap is not None:
            add(q, "phrase-swap", swap, 1, [{"start": 0, "end": len(swap)}])
        where = sentence_around(q.context, start, start + len(answer))
        if where is None or where[1] - where[0] > MAX_SENTENCE_CHARS:
            continue
        sentence = q.context[where[0]:where[1]]
        add(q, "sentence", sentence, 0, [])
        if swap is not None:
            at = start - where[0]
            add(q, "sentence-swap", sentence[:at] + swap + sentence[at + len(answer):], 1,
                [{"start": at, "end": at + len(swap)}])
    for q in rng.sample(unanswerable, min(n_unanswerable, len(unanswerable))):
        text = q.plausible[0][0].strip()
        if text:
            add(q, "unanswerable", text, 1, [{"start": 0, "end": len(text)}])
    return samples
