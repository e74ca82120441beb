"""HalMit's monitor (section 3.2, Algorithm 1, eq. 7): is a query beyond the agent's generalization bound?

1. Embed the query (unit vector ``Q_v``) and find the stored boundary points most similar to it.
2. If at least three of them have similarity ``S_i > eps`` (Algorithm 1 line 14: the third most similar exceeds
   ``eps``), the centroid ``C = sum_i S_i v_i / sum_i S_i`` of the top three (eq. 7) is normalised and compared with
   the query: ``S_C >= eps`` means the query lies on the explored boundary -> likely hallucination (case 1).
3. Otherwise the query's semantic entropy (K answers of the agent) is compared with the entropy of the most similar
   stored point (section 3.2's text; Algorithm 1 writes the maximum over points, we follow the text, where the
   comparison is local): higher -> likely hallucination (case 2), else within the bound (case 3).

Note: with unit vectors, ``S_C >= sum_i S_i^2 / sum_i S_i >= min_i S_i``, so when the three most similar points all
exceed ``eps`` the centroid test passes too: case 1 is decided by line 14 alone, as the section's text says.

``score`` is a number for ranking queries (AUROC): ``0.5 + 0.5 * tanh(margin)`` with ``margin = (S_C - eps) /
0.05`` in case 1 and ``H_q - H_nearest`` in cases 2-3, so ``score >= 0.5`` exactly when the query is flagged.
"""

from __future__ import annotations

import math

import numpy as np

EPSILON = 0.8


def decide(store, query_vector, query_entropy=None, epsilon: float = EPSILON) -> dict:
    """Algorithm 1 for a query vector. ``query_entropy``: the query's semantic entropy, needed only when case 1
    does not decide (with ``None`` the verdict's case is then ``"needs entropy"``). Returns the verdict with its
    evidence."""
    q = np.asarray(query_vector, dtype=np.float32)
    q = q / np.linalg.norm(q)
    near = store.nearest(q, 3)
    evidence = [{"id": p["id"], "query": p["query"], "similarity": round(s, 4), "entropy": round(p["entropy"], 4)}
                for p, s, _ in near]
    verdict = {"neighbours": evidence, "epsilon": epsilon, "centroid_similarity": None, "query_entropy": None}
    if not near:
        verdict.update(case="empty store", hallucination=False, score=0.49, reason="the store has no boundary points")
        return verdict
    if len(near) >= 3 and near[2][1] > epsilon:
        sims = np.array([s for _, s, _ in near])
        centroid = (sims[:, None] * np.stack([v for _, _, v in near])).sum(0) / sims.sum()  # eq. 7
        s_c = float(q @ (centroid / np.linalg.norm(centroid)))
        verdict["centroid_similarity"] = round(s_c, 4)
        if s_c >= epsilon:
            verdict.update(case="centroid", hallucination=True, score=0.5 + 0.5 * math.tanh((s_c - epsilon) / 0.05),
                           reason=f"the query is within similarity {epsilon} of the centroid of three boundary points")
            return verdict
    if query_entropy is None:
        verdict.update(case="needs entropy", hallucination=None, score=None, reason="")
        return verdict
    h_q = float(query_entropy)
    h_n = float(near[0][0]["entropy"])
    verdict["query_entropy"] = round(h_q, 4)
    flagged = h_q > h_n
    verdict.update(case="entropy above" if flagged else "entropy below", hallucination=flagged,
                   score=0.5 + 0.5 * math.tanh(h_q - h_n) if h_q != h_n else 0.49,
                   reason=f"semantic entropy {h_q:.3f} of the query {'>' if flagged else '<='} {h_n:.3f} of the most "
                          f"similar boundary point")
    return verdict


def calibrate_epsilon(hallucinated, query_vectors, event_ids, point_ids, point_vectors, precision: float = 0.8,
                      min_support: int = 5, grid=None) -> dict:
    """``epsilon`` for this store's embedder, from its explored queries (leave-one-out): the smallest threshold at
    which case 1 of Algorithm 1 (the third most similar boundary point, the query's own point left out, above
    ``epsilon``) fires on at least ``min_support`` explored queries and at least ``precision`` of them were
    hallucinated, or half-way from the explored base rate to 1 when that is higher (so that case 1 must beat a guess
    at the base rate). The paper's 0.8 was set for m3e-base; with another embedder similarities sit elsewhere (with
    all-MiniLM-L6-v2, case 1 never fired at 0.8 on 160 benchmark queries). When no threshold qualifies, the paper's
    value is kept and the record says so. With few grounded explored queries the calibration has little to go on:
    the record gives the base rate and the support."""
    labels = np.asarray(hallucinated, dtype=bool)
    if len(labels):
        precision = max(precision, (1.0 + float(labels.mean())) / 2)
    grid = np.round(np.arange(0.50, 0.951, 0.01), 2) if grid is None else np.asarray(grid)
    third = np.full(len(labels), -np.inf)
    if len(point_ids) >= 3 and len(labels):
        sims = np.asarray(query_vectors, dtype=np.float32) @ np.asarray(point_vectors, dtype=np.float32).T
        own = np.asarray(event_ids)[:, None] == np.asarray(point_ids)[None, :]
        sims[own] = -np.inf  # leave the query's own boundary point out
        if sims.shape[1] - own.any(1).max() >= 3:
            third = -np.sort(-sims, axis=1)[:, 2]
    record = {"value": EPSILON, "method": "paper default (no threshold reached the precision)", "target_precision":
              round(precision, 4), "min_support": min_support, "explored": int(len(labels)),
              "base_rate": round(float(labels.mean()), 4) if len(labels) else None}
    for t in grid:
        fires = third > t
        if fires.sum() >= min_support and labels[fires].mean() >= precision:
            record.update(value=float(t), method="calibrated on the explored queries", fires=int(fires.sum()),
                          precision=round(float(labels[fires].mean()), 4))
            return record
    fires = third > EPSILON
    record.update(fires=int(fires.sum()),
                  precision=round(float(labels[fires].mean()), 4) if fires.any() else None)
    return record
