"""Semantic entropy's one clustering and one entropy, for both of its users: the sampling baseline
(:class:`halwatch.detectors.sampling.SemanticEntropy`, Kuhn et al. 2023, white-box: each cluster weighs its members'
sequence probabilities) and HalMit's watchdog (:mod:`halwatch.watchdog.entropy`, Farquhar et al. 2024's discrete
estimator for black-box agents: each cluster weighs its share of the answers).

Answers are grouped as in Kuhn et al.'s Algorithm 1 (Farquhar et al., Methods): each joins the first cluster whose
first member means the same, or opens a new one. :func:`cluster_steps` is that loop once; :func:`clusters` and
:func:`clusters_async` drive it with a judgement that is a plain or an awaitable function.
"""

from __future__ import annotations

import numpy as np

#: The one entailment question asked of a judge model ("does A imply B?"), both directions for equivalence.
ENTAILMENT_PROMPT = ("Statement A: {a}\nStatement B: {b}\n\nDoes statement A imply statement B{about}? Answer yes or "
                     "no.\n\nAnswer:")


def entailment_prompt(a: str, b: str, question: str = "") -> str:
    """The question "does ``a`` imply ``b``?" (in the context of ``question`` where one is given)."""
    about = f", in the context of the question \"{question}\"" if question else ""
    return ENTAILMENT_PROMPT.format(a=a, b=b, about=about)


def cluster_steps(n: int):
    """Algorithm 1 over ``n`` answers as a generator: yields ``(answer, first member of a cluster)`` pairs to judge,
    is sent whether the two mean the same, and returns the cluster index of each answer."""
    heads: list[int] = []
    ids: list[int] = []
    for i in range(n):
        match = None
        for c, head in enumerate(heads):
            if (yield i, head):
                match = c
                break
        if match is None:
            heads.append(i)
            match = len(heads) - 1
        ids.append(match)
    return ids


def clusters(n: int, same) -> list[int]:
    """:func:`cluster_steps` with ``same(i, head) -> bool``."""
    steps = cluster_steps(n)
    try:
        pair = next(steps)
        while True:
            pair = steps.send(bool(same(*pair)))
    except StopIteration as done:
        return done.value


async def clusters_async(n: int, same) -> list[int]:
    """:func:`cluster_steps` with an awaitable ``same(i, head)`` (a judge reached over HTTP)."""
    steps = cluster_steps(n)
    try:
        pair = next(steps)
        while True:
            pair = steps.send(bool(await same(*pair)))
    except StopIteration as done:
        return done.value


def cluster_entropy(ids, weights=None) -> float:
    """Entropy (nats) over clusters: each cluster's probability is the sum of its members' ``weights`` (Kuhn et al.
    eq. 2-3: length-normalised sequence probabilities), normalised; without weights, its share of the answers
    (Farquhar et al.'s discrete estimator, ``-sum_c (|c|/K) log(|c|/K)``). 0 when all answers agree."""
    ids = np.asarray(ids)
    weights = np.ones(len(ids)) if weights is None else np.asarray(weights, dtype=float)
    p = np.array([weights[ids == c].sum() for c in np.unique(ids)])
    p = p / p.sum()
    return float(-(p * np.log(p)).sum()) if len(p) > 1 else 0.0
