"""The grounded SQuAD answers evidence is measured on (issue 76), each with its gold context sentence: the one that
holds SQuAD's gold answer, cut by :func:`halwatch.sentences.sentence_ranges` (answers whose gold answer spans two
sentences are left out).

- ``copied``: squad-shapes' grounded ``phrase`` (the gold answer alone) and ``sentence`` (the gold sentence copied)
  answers of a split;
- ``long``: copied and restated answers whose passage is put among eight passages of other articles (four before,
  four after), a context longer than the 1024-token cap that halwatch scores in windows;
- ``restated``: the question answered in its own words, made by rule from SQuAD questions of the split: a subject
  question (``Who`` + a verb in -s or -ed, ``What`` + a verb in -ed) with the wh-word replaced by the gold answer, and
  ``What|Who is|are|was|were X?`` as ``<answer> is|are|was|were X.`` (not where X ends in a preposition, ``called``,
  ``named`` or a past participle, which would need the words reordered). SQuAD's crowd workers were asked to write
  questions in their own words, so these answers paraphrase the gold sentence more than the copied ones; each row
  records the share of the answer's other words that the gold sentence holds.
- ``generated``: dialogue replies that human raters judged fully supported by their one Wikipedia sentence (BEGIN's
  Wizard-of-Wikipedia replies rated "Fully attributable", FaithDial's audited Wizard-of-Wikipedia replies rated
  "entailment" alone), written by dialogue models (GPT-2, T5, CTRL, DoHA) and by people, never by rule. Each gold
  sentence is put among the four other Wizard-of-Wikipedia sentences of the two sets that share most of its content
  words (a retriever's neighbours: same topic, most often; near copies, sharing more than half, are left out), one
  per line, in a seeded order. The gold range is the whole gold sentence; the row's overlap is the share of the
  reply's content words the gold sentence holds.
"""

from __future__ import annotations

import re

import numpy as np

from halwatch.data.shapes import build_squad_shapes
from halwatch.data.shared import read_shared
from halwatch.data.splits import split_of, split_of_source
from halwatch.data.squad import read_squad
from halwatch.sample import Sample
from halwatch.sentences import sentence_ranges

WORD = re.compile(r"\w+")
AUX = {"do", "does", "did", "is", "are", "was", "were", "has", "have", "had", "can", "could", "will", "would",
       "should", "may", "might", "must", "shall"}
COPULA = {"is", "are", "was", "were"}
#: Question endings that a copula answer cannot keep in place ("What is it called?" -> "X is it called.").
BAD_END = re.compile(r"(\b(called|named|of|for|in|on|with|by|from|to|about|at|as|into|after|like|known|made|used|"
                     r"considered|located|based|found|do|does|did|have|has)|ed|en)$")
STOP = {"the", "a", "an", "of", "in", "on", "to", "and", "or", "is", "are", "was", "were", "by", "for", "with", "as",
        "at", "that", "this", "it", "its", "from", "be", "been", "which", "who", "what"}


def gold_of(context: str, start: int, length: int) -> tuple[int, int] | None:
    """The sentence of ``context`` that holds ``[start, start + length)``, or ``None``."""
    for a, b in sentence_ranges(context):
        if a <= start and start + length <= b:
            return a, b
    return None


def restate(question: str, answer: str) -> str | None:
    """The question answered in a sentence of its own words, or ``None`` where the rule does not apply."""
    q = question.strip().rstrip("?").strip()
    words = q.split()
    if len(words) < 3 or words[0] not in ("Who", "What", "Which"):
        return None
    answer = answer.strip().rstrip(".")
    answer = answer[0].upper() + answer[1:]
    second = words[1].lower()
    if second in COPULA:
        if words[0] == "Which" or BAD_END.search(q.lower()):
            return None
        return f"{answer} {second} {' '.join(words[2:])}."
    verb = r"[a-z]+(s|ed)" if words[0] == "Who" else r"[a-z]+ed"  # "What thesis ...": a noun, not a verb
    if second in AUX or words[0] == "Which" or not re.fullmatch(verb, second):
        return None  # "What did X do", "Which country won" (the noun would stay), "What type of ..."
    return f"{answer} {' '.join(words[1:])}."


def overlap(response: str, answer: str, sentence: str) -> float:
    """The share of the response's content words, less the answer's, that ``sentence`` holds."""
    own = {w for w in WORD.findall(response.lower()) if w not in STOP} - set(WORD.findall(answer.lower()))
    return len(own & set(WORD.findall(sentence.lower()))) / len(own) if own else 1.0


def copied(split: str) -> list[dict]:
    """squad-shapes' grounded ``phrase`` and ``sentence`` answers of ``split``."""
    starts = {q.id: (q.answer_starts[0], q.answers[0]) for q in read_squad() if q.answer_starts}
    rows = []
    for s in build_squad_shapes():
        if split_of(s) != split or s.meta["shape"] not in ("phrase", "sentence"):
            continue
        start, answer = starts[s.meta["question_id"]]
        gold = gold_of(s.context, start, len(answer))
        if gold is not None:
            rows.append({"sample": s, "kind": s.meta["shape"], "gold": gold, "answer_start": start,
                         "overlap": overlap(s.response, answer, s.context[gold[0]:gold[1]])})
    return rows


def restated(split: str, n: int, seed: int = 0) -> list[dict]:
    """Up to ``n`` restated answers of ``split``'s SQuAD questions (a seeded draw)."""
    rows = []
    for q in read_squad():
        if not q.answer_starts or split_of_source(f"squad/{q.title}") != split:
            continue
        response = restate(q.question, q.answers[0])
        gold = gold_of(q.context, q.answer_starts[0], len(q.answers[0])) if response else None
        if gold is None:
            continue
        sample = Sample(context=q.context, question=q.question, response=response, id=f"{q.id}-restated",
                        meta={"title": q.title, "question_id": q.id})
        rows.append({"sample": sample, "kind": "restated", "gold": gold, "answer_start": q.answer_starts[0],
                     "overlap": overlap(response, q.answers[0], q.context[gold[0]:gold[1]])})
    pick = np.random.default_rng(seed).choice(len(rows), size=min(n, len(rows)), replace=False)
    return [rows[i] for i in sorted(pick)]


def lexical(row: dict) -> tuple[int, int]:
    """The lexical baseline: the context sentence with the most words of the answer (lower case; ties: the
    first)."""
    context, response = row["sample"].context, row["sample"].response
    words = set(WORD.findall(response.lower()))
    units = sentence_ranges(context)
    scores = [len(words & set(WORD.findall(context[a:b].lower()))) for a, b in units]
    return units[int(np.argmax(scores))]


def long_contexts(rows: list[dict], n: int, pool: list[dict], seed: int = 0) -> list[dict]:
    """The first ``n`` of ``rows`` with their passage among eight passages of other articles of ``pool`` (four
    before it, four after), as ``long`` rows (gold sentence and answer start moved with it)."""
    rng = np.random.default_rng(seed)
    passages = {r["sample"].context: r["sample"].meta["title"] for r in pool}
    out = []
    for row in rows[:n]:
        s = row["sample"]
        others = sorted(c for c, title in passages.items() if title != s.meta["title"])
        picked = [others[i] for i in rng.choice(len(others), size=8, replace=False)]
        before = "\n\n".join(picked[:4]) + "\n\n"
        context = before + s.context + "\n\n" + "\n\n".join(picked[4:])
        shift = len(before)
        sample = Sample(context=context, question=s.question, response=s.response, id=f"{s.id}-long",
                        meta={"title": s.meta["title"], "question_id": s.meta["question_id"]})
        out.append({**row, "sample": sample, "kind": "long", "gold": (row["gold"][0] + shift, row["gold"][1] + shift),
                    "answer_start": row["answer_start"] + shift})
    return out


def _content(text: str) -> set[str]:
    return {w for w in WORD.findall(text.lower()) if w not in STOP}


def _supported_wow() -> list:
    """The rated-supported Wizard-of-Wikipedia replies of BEGIN and FaithDial's audit (every split)."""
    out = []
    for s in read_shared("begin", per_source=None):
        if s.meta.get("data_source") == "wow" and s.meta.get("begin_label") == "Fully attributable":
            out.append(s)
    for s in read_shared("faithdial", per_source=None):
        if s.meta.get("dataset") == "WoW" and s.meta.get("begin_labels") == ["entailment"]:
            out.append(s)
    return out


def generated(split: str, neighbours: int = 4, seed: int = 0) -> list[dict]:
    """The ``generated`` rows of ``split`` (module docstring): each reply with its gold sentence among its
    ``neighbours`` nearest other sentences."""
    replies = _supported_wow()
    texts = {s.context.strip().lower(): s.context.strip() for s in read_shared("begin", per_source=None)
             + read_shared("faithdial", per_source=None)
             if s.meta.get("data_source") == "wow" or s.meta.get("dataset") == "WoW"}
    pool = sorted(texts.values())  # one copy of sentences that differ only in case
    words = [_content(c) for c in pool]
    rng = np.random.default_rng(seed)
    rows = []
    for s in replies:
        if s.meta["split"] != split or len(_content(s.response)) < 3:
            continue
        gold = s.context.strip()
        own = _content(gold)
        shared = [(len(own & w) / len(own | w) if own | w else 0.0, c) for c, w in zip(pool, words)
                  if c.lower() != gold.lower()]
        near = [c for share, c in sorted(shared, key=lambda x: -x[0]) if share <= 0.5][:neighbours]
        order = [gold] + near
        rng.shuffle(order)
        context = "\n".join(order)  # one retrieved sentence per line (many are lower case: no cut at ". a")
        start = context.index(gold)
        sample = Sample(context=context, question=s.question, response=s.response, id=f"{s.id}-among",
                        meta={"source_id": s.meta["source_id"], "model": s.meta.get("model")})
        rows.append({"sample": sample, "kind": "generated", "gold": (start, start + len(gold)),
                     "answer_start": start, "overlap": overlap(s.response, "", gold)})
    return rows
