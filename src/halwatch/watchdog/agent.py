"""The agent HalMit watches, and the domain it works in.

A **domain** (:class:`Domain`) is what the watchdog knows of the agent's field: a title, passages of text (one SQuAD
article's paragraphs, as in the paper's section 4.1, or the user's own documents: ``--corpus``) and questions with
reference answers (the article's SQuAD questions, or ``--seeds FILE``). The watchdog seeds its exploration from the
questions, generates new queries from the passages, and labels answers against the references or the passages.

An **agent** is anything with this protocol (:class:`Agent`)::

    class MyAgent:
        name = "my-agent"            # recorded in the store
        calls = 0                    # optional: LLM calls made, reported in the summary

        async def answer(self, query, n=1, temperature=0.0, seed=0, logprobs=False):
            ...                      # retrieve, ask the LLM n times
            return context, completions   # context: the text it answered from, or None; completions: n Completion

Two come with halwatch: :class:`TargetAgent`, a built-in RAG agent (retrieval over the domain's passages with
all-MiniLM-L6-v2, then any LLM client), and :class:`EndpointAgent`, a black-box agent behind an OpenAI-compatible chat
endpoint (``--agent URL``): it is sent the query alone and does its own retrieval; its context is unknown (``None``),
so the evaluation agent judges its answers against the domain's passages.
"""

from __future__ import annotations

import functools
import json
import random
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from halwatch.errors import InputError
from halwatch.watchdog.embed import embed

SYSTEM = ("You answer questions about {domain} using only the context given. Answer briefly, in one sentence. "
          "If the context does not contain the answer, say so.")
CORPUS_SUFFIXES = (".txt", ".md", ".markdown", ".jsonl")
PASSAGE_CHARS = (200, 1500)  # passages: paragraphs merged up to at least 200 characters, cut at about 1,500


@dataclass
class DomainQuestion:
    id: str
    question: str
    answers: list[str]


class Domain:
    """Passages and questions of one domain. Build one with :meth:`squad`, :meth:`corpus` or :func:`open_domain`."""

    def __init__(self, title: str, documents: list[str], questions: list[DomainQuestion]):
        self.title, self.documents, self.questions = title, documents, questions
        self._vectors = None

    @classmethod
    def squad(cls, title: str, path=None) -> Domain:
        """The paragraphs and answerable questions of one SQuAD article (``title`` with spaces or underscores)."""
        from halwatch.data.squad import read_squad

        wanted = title.strip().replace(" ", "_")
        if not wanted:
            raise InputError("empty domain: give a SQuAD article title (e.g. Warsaw)")
        questions = read_squad(path)
        titles = sorted({q.title for q in questions})
        if wanted not in titles:
            raise InputError(f"no SQuAD article titled {title!r}; titles: {', '.join(titles)}")
        mine = [q for q in questions if q.title == wanted]
        return cls(wanted.replace("_", " "), list(dict.fromkeys(q.context for q in mine)),
                   [DomainQuestion(q.id, q.question, q.answers) for q in mine if not q.is_impossible])

    @classmethod
    def corpus(cls, path, title: str | None = None) -> Domain:
        """The user's documents: a folder (searched recursively) of ``.txt`` / ``.md`` files (split into passages at
        blank lines) and ``.jsonl`` files (one object per line with ``text``), or one such file."""
        root = Path(path).expanduser()
        if not root.exists():
            raise InputError(f"--corpus {path}: no such file or folder")
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        files = [p for p in files if p.suffix.lower() in CORPUS_SUFFIXES]
        passages: list[str] = []
        for file in files:
            for text in _documents(file):
                passages.extend(split_passages(text))
        passages = list(dict.fromkeys(passages))
        if not passages:
            raise InputError(f"--corpus {path}: no text found (give {', '.join(CORPUS_SUFFIXES)} files)")
        return cls(title or (root.stem if root.is_file() else root.resolve().name), passages, [])

    @property
    def vectors(self) -> np.ndarray:
        if self._vectors is None:
            self._vectors = _passage_vectors(tuple(self.documents))
        return self._vectors

    def retrieve(self, query: str, k: int = 2) -> list[str]:
        """The ``k`` passages most similar to ``query``."""
        sims = self.vectors @ embed([query])[0]
        return [self.documents[i] for i in np.argsort(-sims, kind="stable")[:k]]

    def passage(self, rng: random.Random) -> str:
        """A passage drawn at random (new queries are generated from it)."""
        return self.documents[rng.randrange(len(self.documents))]


_EMBEDDING = threading.Lock()


def _passage_vectors(documents: tuple[str, ...]) -> np.ndarray:
    """The embeddings of a domain's passages, computed once per process (a few seconds for a SQuAD article on a
    CPU): every command over the same passages in one process, and every thread of an exploration, reads them."""
    with _EMBEDDING:
        return _embedded(documents)


@functools.lru_cache(maxsize=8)
def _embedded(documents: tuple[str, ...]) -> np.ndarray:
    vectors = embed(list(documents))
    vectors.setflags(write=False)
    return vectors


def _documents(file: Path):
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--corpus: cannot read {file}: {exc}") from None
    if file.suffix.lower() != ".jsonl":
        yield text
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            body = row.get("text", row.get("content")) if isinstance(row, dict) else None
        except json.JSONDecodeError as exc:
            raise InputError(f"--corpus: {file}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(body, str):
            raise InputError(f"--corpus: {file}:{number}: each line needs a \"text\" string")
        yield body


def split_passages(text: str) -> list[str]:
    """Paragraphs (split at blank lines; Markdown headings kept with what follows), merged until each has at least
    ``PASSAGE_CHARS[0]`` characters, and cut at a sentence end near ``PASSAGE_CHARS[1]``."""
    low, high = PASSAGE_CHARS
    out, current = [], ""
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        block = " ".join(block.split())
        if not block:
            continue
        current = f"{current} {block}".strip()
        while len(current) > high:
            cut = current.rfind(". ", low, high)
            cut = cut + 1 if cut > 0 else high
            out.append(current[:cut].strip())
            current = current[cut:].strip()
        if len(current) >= low:
            out.append(current)
            current = ""
    if current:
        if out and len(current) < low:
            out[-1] = f"{out[-1]} {current}"
        else:
            out.append(current)
    return out


def read_seeds(path) -> list[DomainQuestion]:
    """``--seeds FILE``: JSONL objects with ``question`` and optional ``answers`` (a list) or ``answer`` (a string),
    or plain text with one question per line."""
    file = Path(path).expanduser()
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--seeds: cannot read {path}: {exc}") from None
    out = []
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"--seeds: {file}:{number}: not JSON ({exc.msg})") from None
            question = row.get("question")
            answers = row.get("answers", [row["answer"]] if "answer" in row else [])
            if isinstance(answers, str):
                answers = [answers]
            if not isinstance(question, str) or not question.strip() or not isinstance(answers, list) \
                    or not all(isinstance(a, str) for a in answers):
                raise InputError(f"--seeds: {file}:{number}: needs \"question\" (text) and optional \"answers\" "
                                 f"(a list of texts)")
            out.append(DomainQuestion(str(row.get("id", f"seed-{number}")), question.strip(), answers))
        else:
            out.append(DomainQuestion(f"seed-{number}", line, []))
    if not out:
        raise InputError(f"--seeds: {file} holds no questions")
    return out


def open_domain(domain: str | None = None, corpus=None, seeds=None) -> Domain:
    """The domain of a command: a SQuAD article (``domain``) or the user's documents (``corpus``, titled ``domain``
    when given), with the questions of ``seeds`` (a file) when given."""
    if corpus:
        the_domain = Domain.corpus(corpus, domain)
    elif domain:
        the_domain = Domain.squad(domain)
    else:
        raise InputError("give --domain (a SQuAD article title) or --corpus (a folder of your documents)")
    if seeds:
        the_domain.questions = read_seeds(seeds)
    return the_domain


class Agent(Protocol):
    """What the watchdog needs of an agent (see the module's docstring)."""

    name: str

    async def answer(self, query: str, n: int = 1, temperature: float = 0.0, seed: int = 0,
                     logprobs: bool = False) -> tuple[str | None, list]: ...


class TargetAgent:
    """Built-in RAG agent: retrieve ``k_docs`` passages of the domain, then ask the LLM with them as context."""

    def __init__(self, domain: Domain, client, k_docs: int = 2, max_tokens: int = 48):
        self.domain, self.client, self.k_docs, self.max_tokens = domain, client, k_docs, max_tokens
        self.name = client.name

    @property
    def calls(self) -> int:
        return self.client.calls

    def messages(self, query: str, context: str) -> list[dict]:
        return [{"role": "system", "content": SYSTEM.format(domain=self.domain.title)},
                {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {query}"}]

    async def answer(self, query: str, n: int = 1, temperature: float = 0.0, seed: int = 0,
                     logprobs: bool = False):
        """``(context, completions)``: the retrieved context and ``n`` answers."""
        if not query.strip():
            raise InputError("empty query")
        context = "\n\n".join(self.domain.retrieve(query, self.k_docs))
        out = await self.client.chat(self.messages(query, context), n=n, temperature=temperature,
                                     max_tokens=self.max_tokens, seed=seed, top_logprobs=1 if logprobs else 0)
        return context, out


class EndpointAgent:
    """A black-box agent behind an OpenAI-compatible chat endpoint (``--agent URL#MODEL``): it gets the query alone,
    as one user message, and answers from its own retrieval. Its context is unknown: ``answer`` returns ``None``."""

    def __init__(self, client, max_tokens: int = 128):
        self.client, self.max_tokens, self.name = client, max_tokens, client.name

    @property
    def calls(self) -> int:
        return self.client.calls

    async def answer(self, query: str, n: int = 1, temperature: float = 0.0, seed: int = 0,
                     logprobs: bool = False):
        if not query.strip():
            raise InputError("empty query")
        out = await self.client.chat([{"role": "user", "content": query}], n=n, temperature=temperature,
                                     max_tokens=self.max_tokens, seed=seed, top_logprobs=1 if logprobs else 0)
        return None, out
