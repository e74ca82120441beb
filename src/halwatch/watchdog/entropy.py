"""Semantic entropy (Farquhar et al., Nature 2024; HalMit Appendix B): sample K answers, group them into clusters
of equal meaning, and take the entropy of the cluster distribution.

Clusters are built as in Farquhar et al.'s Algorithm 1: each answer joins the first cluster whose first member it
is equivalent to, or opens a new one. Equivalence is either

- ``entailment`` (the paper's, used whenever a judge LLM is given: ``--judge``): the judge says "yes" to "does A imply
  B?" in both directions, or
- ``embedding`` (the fallback without a judge, labelled so in the store): cosine similarity of the all-MiniLM-L6-v2
  embeddings >= ``threshold`` (0.85). It is a crude stand-in: it merges answers that differ in one number ("1.7
  million" and "3.1 million" score 0.954) and splits some paraphrases (0.637).

The entropy is the discrete estimator (each cluster weighted by its share of the K answers), the variant for
black-box models whose token probabilities are not available: ``H = -sum_c (|c|/K) log(|c|/K)``.
"""

from __future__ import annotations

import math

import numpy as np

from halwatch.watchdog.clients import yes_probability
from halwatch.watchdog.embed import embed

THRESHOLD = 0.85
ENTAIL = ("Statement A: {a}\nStatement B: {b}\n\nDoes statement A imply statement B, in the context of the question "
          "\"{q}\"? Answer yes or no.")


def entropy_of(cluster_ids) -> float:
    """Discrete entropy (nats) of cluster assignments."""
    _, counts = np.unique(np.asarray(cluster_ids), return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum()) if len(p) > 1 else 0.0


def embedding_clusters(texts, threshold: float = THRESHOLD) -> list[int]:
    vectors = embed(texts)
    heads: list[int] = []
    ids = []
    for i in range(len(texts)):
        match = next((c for c, h in enumerate(heads) if float(vectors[i] @ vectors[h]) >= threshold), None)
        if match is None:
            heads.append(i)
            match = len(heads) - 1
        ids.append(match)
    return ids


async def entailment_clusters(texts, question: str, judge) -> list[int]:
    heads: list[int] = []
    ids = []
    for i, text in enumerate(texts):
        match = None
        for c, h in enumerate(heads):
            both = [await judge.chat([{"role": "user", "content": ENTAIL.format(a=a, b=b, q=question)}],
                                     max_tokens=1, top_logprobs=5) for a, b in ((text, texts[h]), (texts[h], text))]
            if all(yes_probability(r[0]) > 0.5 for r in both):
                match = c
                break
        if match is None:
            heads.append(i)
            match = len(heads) - 1
        ids.append(match)
    return ids


async def semantic_entropy(texts, question: str = "", method: str = "embedding", judge=None,
                           threshold: float = THRESHOLD) -> float:
    """Semantic entropy of the answers ``texts`` (nats, 0 when all agree, log K when all differ)."""
    texts = [str(t).strip() for t in texts]
    if not texts:
        return math.nan
    if method == "embedding":
        return entropy_of(embedding_clusters(texts, threshold))
    if method == "entailment":
        if judge is None:
            raise ValueError("entailment clustering needs a judge client")
        return entropy_of(await entailment_clusters(texts, question, judge))
    raise ValueError(f"unknown clustering {method!r}: embedding or entailment")
