"""Semantic entropy (Farquhar et al., Nature 2024; HalMit Appendix B): sample K answers, group them into clusters
of equal meaning, and take the entropy of the cluster distribution.

Clusters are built as in Farquhar et al.'s Algorithm 1 (:mod:`halwatch.clustering`, shared with the sampling
baseline): each answer joins the first cluster whose first member it is equivalent to, or opens a new one.
Equivalence is either

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

from halwatch.clustering import cluster_entropy, clusters, clusters_async, entailment_prompt
from halwatch.watchdog.clients import yes_probability
from halwatch.watchdog.embed import embed

THRESHOLD = 0.85


def entropy_of(cluster_ids) -> float:
    """Discrete entropy (nats) of cluster assignments."""
    return cluster_entropy(cluster_ids)


def embedding_clusters(texts, threshold: float = THRESHOLD) -> list[int]:
    vectors = embed(texts)
    return clusters(len(texts), lambda i, h: float(vectors[i] @ vectors[h]) >= threshold)


async def entailment_clusters(texts, question: str, judge) -> list[int]:
    async def implies(a: str, b: str) -> bool:
        reply = await judge.chat([{"role": "user", "content": entailment_prompt(a, b, question)}], max_tokens=1,
                                 top_logprobs=5)
        return yes_probability(reply[0]) > 0.5

    async def same(i: int, h: int) -> bool:  # both directions asked, as before: the second even after a no
        both = [await implies(texts[i], texts[h]), await implies(texts[h], texts[i])]
        return all(both)

    return await clusters_async(len(texts), same)


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
