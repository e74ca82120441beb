"""The target agent of HalMit (section 4.2): a retrieval-augmented agent for one domain. Its documents are the
paragraphs of one SQuAD article (the paper's domains are SQuAD titles); its retriever ranks them by cosine
similarity of all-MiniLM-L6-v2 embeddings; its LLM is any client of :mod:`halwatch.watchdog.clients`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from halwatch.errors import InputError
from halwatch.watchdog.embed import embed

SYSTEM = ("You answer questions about {domain} using only the context given. Answer briefly, in one sentence. "
          "If the context does not contain the answer, say so.")


@dataclass
class DomainQuestion:
    id: str
    question: str
    answers: list[str]


class Domain:
    """Paragraphs and answerable questions of one SQuAD article. ``title`` may use spaces or underscores."""

    def __init__(self, title: str, path=None):
        from halwatch.data.squad import read_squad

        wanted = title.strip().replace(" ", "_")
        if not wanted:
            raise InputError("empty domain: give a SQuAD article title (e.g. Warsaw)")
        questions = read_squad(path)
        titles = sorted({q.title for q in questions})
        if wanted not in titles:
            raise InputError(f"no SQuAD article titled {title!r}; titles: {', '.join(titles)}")
        mine = [q for q in questions if q.title == wanted]
        self.title = wanted.replace("_", " ")
        self.documents = list(dict.fromkeys(q.context for q in mine))
        self.questions = [DomainQuestion(q.id, q.question, q.answers) for q in mine if not q.is_impossible]
        self._vectors = None

    @property
    def vectors(self) -> np.ndarray:
        if self._vectors is None:
            self._vectors = embed(self.documents)
        return self._vectors

    def retrieve(self, query: str, k: int = 2) -> list[str]:
        """The ``k`` paragraphs most similar to ``query``."""
        sims = self.vectors @ embed([query])[0]
        return [self.documents[i] for i in np.argsort(-sims, kind="stable")[:k]]


class TargetAgent:
    """RAG agent: retrieve ``k_docs`` paragraphs, then ask the LLM with them as context."""

    def __init__(self, domain: Domain, client, k_docs: int = 2, max_tokens: int = 48):
        self.domain, self.client, self.k_docs, self.max_tokens = domain, client, k_docs, max_tokens

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
