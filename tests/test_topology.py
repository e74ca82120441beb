"""Tests of halwatch.signals.topology: MTop-Div_G(R, P) (TOHA, Sec. 3.1, Prop. 3.1, eq. 3) and the MST-length ablation.

Paper references are to shared/papers/toha.md.  ripser (a test dependency only) is the independent cross-check.

Why ripser's finite H0 bars sum to the MSF weight: in the Vietoris-Rips filtration of a distance matrix every point
is born at 0, and an H0 class dies exactly when Kruskal's algorithm adds an edge that merges two components, at that
edge's length (App. B).  So the deaths are the n - 1 MST edge lengths and one bar never dies (the infinite one).
With the prompt-prompt block zeroed, the prompt points all merge at 0 (|P| - 1 zero-length bars, which ripser does not
even report) and the rest of the MST is the minimum spanning forest attaching R to P (Prop. 3.1): its |R| edges are
the remaining deaths (those of length 0 are likewise unreported), so sum(death - birth) over finite bars = MSF weight.

Precision: ripser casts the distance matrix to float32, so each of its deaths is off by at most 2^-25 (< 3e-8) from the
float64 value; over |R| <= 32 bars the sum is within 1e-6 in the worst case.  Larger |R| get tolerance |R| * 3e-8.
"""

from __future__ import annotations

import numpy as np
import pytest

from halwatch.signals import topology
from halwatch.signals.topology import MSTLengthResult, MTopDivResult, mst_length, mtopdiv

F32_ULP_HALF = 2.0**-25  # max float32 rounding error of a value in [0, 1]


# ----------------------------------------------------------------------------------------------------------- helpers
def causal_attention(rng, n_heads, n, scale=3.0, sparsity=0.0, dtype=np.float64):
    """Row-stochastic lower-triangular maps [H, n, n]: softmax of random logits under a causal mask.

    ``scale`` large -> peaked (near one-hot) rows; ``sparsity`` = fraction of visible keys additionally masked
    (exact zeros; the diagonal is always kept so every row has support).
    """
    logits = rng.normal(size=(n_heads, n, n)) * scale
    mask = np.triu(np.ones((n, n), dtype=bool), 1)[None].repeat(n_heads, 0)
    if sparsity > 0:
        mask |= rng.random((n_heads, n, n)) < sparsity
        mask[:, np.arange(n), np.arange(n)] = False
    logits[mask] = -np.inf
    logits -= logits.max(-1, keepdims=True)
    att = np.exp(logits)
    att /= att.sum(-1, keepdims=True)
    return att.astype(dtype)


def distance_matrix(att_head, n_prompt=None):
    """Full n x n distance 1 - max(w, w^T) of one head, zero diagonal; prompt block zeroed when n_prompt is given."""
    w = np.clip(np.asarray(att_head, dtype=np.float64), 0.0, 1.0)
    dist = 1.0 - np.maximum(w, w.T)
    if n_prompt is not None:
        dist[:n_prompt, :n_prompt] = 0.0
    np.fill_diagonal(dist, 0.0)
    return dist


def ripser_h0_deaths(dist):
    """Deaths of the finite H0 bars of the VR filtration of ``dist`` (checks every birth is 0)."""
    ripser = pytest.importorskip("ripser")
    dgm = ripser.ripser(dist, distance_matrix=True, maxdim=0)["dgms"][0]
    finite = dgm[np.isfinite(dgm[:, 1])]
    assert np.sum(~np.isfinite(dgm[:, 1])) == 1  # exactly one infinite bar: the graph is connected
    assert np.all(finite[:, 0] == 0.0)
    return np.sort(finite[:, 1].astype(np.float64))


def full_from_rows(rows, n_prompt):
    """Embed response rows [H, R, n] into full maps [H, n, n] whose prompt rows put no weight on response keys."""
    n_heads, n_resp, n = rows.shape
    full = np.zeros((n_heads, n, n))
    full[:, n_prompt:, :] = rows
    return full


# --------------------------------------------------------------------------------------- MTop-Div vs ripser (Prop 3.1)
RIPSER_CASES = [
    # (seed, n_heads, n_prompt, n_resp, scale, sparsity, dtype)
    (0, 3, 5, 7, 3.0, 0.0, np.float64),
    (1, 2, 1, 1, 3.0, 0.0, np.float64),  # R = 1, |P| = 1
    (2, 4, 1, 12, 3.0, 0.0, np.float64),  # |P| = 1
    (3, 4, 20, 1, 3.0, 0.0, np.float64),  # R = 1
    (4, 1, 8, 32, 1.0, 0.0, np.float64),  # flat-ish attention
    (5, 3, 10, 30, 12.0, 0.0, np.float64),  # peaked, near one-hot
    (6, 3, 16, 24, 3.0, 0.8, np.float64),  # sparse: many exact zeros -> many ties at distance 1
    (7, 3, 6, 20, 30.0, 0.5, np.float64),  # peaked and sparse
    (8, 5, 12, 25, 3.0, 0.0, np.float32),  # float32 input
    (9, 2, 3, 17, 12.0, 0.3, np.float32),
    (10, 2, 40, 100, 3.0, 0.0, np.float64),  # larger R: tolerance R * 3e-8
]


@pytest.mark.parametrize("seed,n_heads,n_prompt,n_resp,scale,sparsity,dtype", RIPSER_CASES)
def test_mtopdiv_matches_ripser(seed, n_heads, n_prompt, n_resp, scale, sparsity, dtype):
    rng = np.random.default_rng(seed)
    att = causal_attention(rng, n_heads, n_prompt + n_resp, scale, sparsity, dtype)
    res = mtopdiv(att[:, n_prompt:, :], n_prompt)
    assert isinstance(res, MTopDivResult)
    assert res.total.shape == res.d.shape == (n_heads,)
    assert res.token_weights.shape == res.parent.shape == (n_heads, n_resp)
    tol = max(1e-6, n_resp * F32_ULP_HALF)
    for h in range(n_heads):
        deaths = ripser_h0_deaths(distance_matrix(att[h], n_prompt))
        assert abs(res.total[h] - deaths.sum()) <= tol
        # Stronger: the multiset of forest edge lengths equals ripser's deaths (zero-length bars are unreported).
        assert len(deaths) <= n_resp
        ours = np.sort(res.token_weights[h])
        theirs = np.concatenate([np.zeros(n_resp - len(deaths)), deaths])
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-7)
    np.testing.assert_allclose(res.d, res.total / n_resp, rtol=1e-15)


@pytest.mark.parametrize("seed", range(20))
def test_mtopdiv_matches_ripser_random_shapes(seed):
    rng = np.random.default_rng(100 + seed)
    n_prompt, n_resp, n_heads = int(rng.integers(1, 30)), int(rng.integers(1, 33)), int(rng.integers(1, 4))
    scale = float(rng.choice([0.5, 3.0, 10.0]))
    sparsity = float(rng.choice([0.0, 0.5, 0.9]))
    att = causal_attention(rng, n_heads, n_prompt + n_resp, scale, sparsity)
    res = mtopdiv(att[:, n_prompt:, :], n_prompt)
    for h in range(n_heads):
        assert abs(res.total[h] - ripser_h0_deaths(distance_matrix(att[h], n_prompt)).sum()) <= 1e-6


def test_noncausal_response_block_uses_symmetric_max():
    # Response rows with weight on later response tokens (not causal): the graph must use max(w_ab, w_ba).
    rng = np.random.default_rng(7)
    n_prompt, n_resp, n_heads = 6, 15, 3
    logits = rng.normal(size=(n_heads, n_resp, n_prompt + n_resp)) * 3
    rows = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    res = mtopdiv(rows, n_prompt)
    full = full_from_rows(rows, n_prompt)
    for h in range(n_heads):
        assert abs(res.total[h] - ripser_h0_deaths(distance_matrix(full[h], n_prompt)).sum()) <= 1e-6


# ----------------------------------------------------------------------------------------------------- hand examples
def test_hand_example_prompt2_response2():
    # n_prompt = 2 (tokens 0, 1), R = 2 (tokens 2, 3).  Rows of the response tokens:
    #   token 2: [0.5, 0.2, 0.3, 0.0] -> d(2, P) = min(1 - 0.5, 1 - 0.2) = 0.5 (via token 0)
    #   token 3: [0.1, 0.1, 0.7, 0.1] -> d(3, P) = 0.9, d(3, 2) = 1 - max(0.7, w_23 = 0) = 0.3
    # Prim from the contracted prompt: token 2 joins at 0.5 (parent 0), then token 3 via token 2 at 0.3 < 0.9.
    # MTop-Div = 0.5 + 0.3 = 0.8, d = 0.8 / 2 = 0.4.
    rows = np.array([[[0.5, 0.2, 0.3, 0.0], [0.1, 0.1, 0.7, 0.1]]])
    res = mtopdiv(rows, 2)
    np.testing.assert_allclose(res.total, [0.8], atol=1e-12)
    np.testing.assert_allclose(res.d, [0.4], atol=1e-12)
    np.testing.assert_allclose(res.token_weights, [[0.5, 0.3]], atol=1e-12)
    np.testing.assert_array_equal(res.parent, [[0, 2]])

    # Second head: token 2 barely looks at the prompt, token 3 copies token 2.
    #   token 2: [0.1, 0.1, 0.8, 0.0]   -> d(2, P) = 0.9
    #   token 3: [0.05, 0.05, 0.9, 0.0] -> d(3, P) = 0.95, d(3, 2) = 0.1
    # Forest: 2 -> P (0.9), 3 -> 2 (0.1): 1.0 (the alternative 3 -> P, 2 -> 3 costs 0.95 + 0.1 = 1.05).
    rows2 = np.array([[[0.1, 0.1, 0.8, 0.0], [0.05, 0.05, 0.9, 0.0]]])
    res2 = mtopdiv(np.concatenate([rows, rows2]), 2)
    np.testing.assert_allclose(res2.total, [0.8, 1.0], atol=1e-12)
    np.testing.assert_allclose(res2.token_weights[1], [0.9, 0.1], atol=1e-12)


def test_hand_example_mst_length():
    # Same response rows as above plus prompt rows p0 = [1, 0, 0, 0], p1 = [0.6, 0.4, 0, 0].  Distances:
    #   p0-p1 0.4, p0-r0 0.5, p1-r0 0.8, p0-r1 0.9, p1-r1 0.9, r0-r1 0.3.
    # MST (Kruskal): r0-r1 0.3, p0-p1 0.4, p0-r0 0.5 -> 1.2; normalised by |R| = 2: 0.6.
    full = np.array(
        [[[1.0, 0.0, 0.0, 0.0], [0.6, 0.4, 0.0, 0.0], [0.5, 0.2, 0.3, 0.0], [0.1, 0.1, 0.7, 0.1]]]
    )
    res = mst_length(full, n_prompt=2)
    assert isinstance(res, MSTLengthResult)
    np.testing.assert_allclose(res.total, [1.2], atol=1e-12)
    np.testing.assert_allclose(res.d, [0.6], atol=1e-12)
    assert mst_length(full).d is None
    # Sec. 3.3: MTop-Div >= L_MST(R u P) - L_MST(P) = 1.2 - 0.4 = 0.8 (equality here).
    assert mtopdiv(full[:, 2:, :], 2).total[0] >= 1.2 - 0.4 - 1e-12


# ----------------------------------------------------------------------------------------- Proposition C.1: bounds
def _adversarial_rows(n_prompt, n_resp):
    """Named adversarial inputs [1, R, n] with their exact MTop-Div."""
    n = n_prompt + n_resp
    out = {}
    self_only = np.zeros((1, n_resp, n))
    self_only[0, np.arange(n_resp), n_prompt + np.arange(n_resp)] = 1.0
    out["all_on_self"] = (self_only, float(n_resp))  # every distance is 1: upper bound |R| attained
    last = np.zeros((1, n_resp, n))
    last[0, :, n - 1] = 1.0  # (non-causal) every token on the last response token: it hangs on P at 1, rest at 0
    out["all_on_last_response"] = (last, 1.0)
    first = np.zeros((1, n_resp, n))
    first[0, :, n_prompt] = 1.0  # every token on the first response token (causal): same, total 1
    out["all_on_first_response"] = (first, 1.0)
    chain = np.zeros((1, n_resp, n))
    chain[0, np.arange(n_resp), n_prompt - 1 + np.arange(n_resp)] = 1.0  # previous token with weight 1: C.1 item 4
    out["previous_token_chain"] = (chain, 0.0)
    on_prompt = np.zeros((1, n_resp, n))
    on_prompt[0, :, 0] = 1.0  # every token on a prompt token with weight 1: lower bound 0 attained
    out["all_on_prompt"] = (on_prompt, 0.0)
    # Uniform over the visible (causal) keys: token r (0-based in R) has weight 1/(P+r+1) on each key <= itself.
    # d(r, P) = 1 - 1/(P+r+1); d(r, r') = 1 - 1/(P+max(r,r')+1) >= d(r, P) for r' != r, so every token hangs on P:
    # MTop-Div = sum_{k=P+1}^{P+R} (1 - 1/k).
    uniform = np.zeros((1, n_resp, n))
    for r in range(n_resp):
        uniform[0, r, : n_prompt + r + 1] = 1.0 / (n_prompt + r + 1)
    ks = np.arange(n_prompt + 1, n_prompt + n_resp + 1)
    out["uniform_causal"] = (uniform, float(np.sum(1.0 - 1.0 / ks)))
    return out


@pytest.mark.parametrize("n_prompt,n_resp", [(1, 1), (1, 5), (4, 1), (7, 13), (30, 40)])
def test_bounds_adversarial(n_prompt, n_resp):
    for name, (rows, expected) in _adversarial_rows(n_prompt, n_resp).items():
        res = mtopdiv(rows, n_prompt)
        assert abs(res.total[0] - expected) <= 1e-9, name
        assert 0.0 <= res.total[0] <= n_resp, name  # eq. (4)
        assert 0.0 <= res.d[0] <= 1.0, name
        if n_resp <= 32:
            full = full_from_rows(rows, n_prompt)[0]
            assert abs(ripser_h0_deaths(distance_matrix(full, n_prompt)).sum() - expected) <= 1e-6, name


@pytest.mark.parametrize("seed", range(10))
def test_bounds_random(seed):
    rng = np.random.default_rng(200 + seed)
    n_prompt, n_resp = int(rng.integers(1, 60)), int(rng.integers(1, 60))
    att = causal_attention(rng, 6, n_prompt + n_resp, float(rng.choice([0.1, 3.0, 50.0])), float(rng.random() * 0.9))
    res = mtopdiv(att[:, n_prompt:, :], n_prompt)
    assert np.all(res.total >= 0.0) and np.all(res.total <= n_resp)  # eq. (4)
    assert np.all(res.d >= 0.0) and np.all(res.d <= 1.0)


# --------------------------------------------------------------------------------------- Proposition C.1: stability
# Prop. C.1 (Stability): "If the weights of G change by no more than eps, then the corresponding MTop-Div(R, P)
# changes by no more than delta = eps |R|."  The weights of G are the distances 1 - max(w_ij, w_ji); changing every
# attention weight by at most eps changes each of them by at most eps (max and the clip to [0, 1] are 1-Lipschitz),
# so the same bound holds for perturbations of the attention rows.
def stability_bound(eps, n_resp):
    return eps * n_resp


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("eps", [1e-4, 1e-2, 0.1, 0.5])
def test_stability_random_perturbation(seed, eps):
    rng = np.random.default_rng(300 + seed)
    n_prompt, n_resp = int(rng.integers(1, 40)), int(rng.integers(1, 40))
    att = causal_attention(rng, 4, n_prompt + n_resp, float(rng.choice([1.0, 5.0])), float(rng.choice([0.0, 0.6])))
    rows = att[:, n_prompt:, :]
    base = mtopdiv(rows, n_prompt).total
    for _ in range(5):
        noise = rng.uniform(-eps, eps, size=rows.shape)
        moved = mtopdiv(rows + noise, n_prompt).total  # may leave [0, 1]: clipped, still within eps
        assert np.all(np.abs(moved - base) <= stability_bound(eps, n_resp) + 1e-12)
    # Edge weights changed directly: every distance down by eps (all weights up by eps, none reaching 1) shifts every
    # edge of every spanning forest by -eps, so the MSF is unchanged and the bound eps |R| is attained exactly.
    if float(rows.max()) + eps < 1.0:
        moved = mtopdiv(rows + eps, n_prompt).total
        np.testing.assert_allclose(base - moved, stability_bound(eps, n_resp), rtol=0, atol=1e-9)


def test_stability_swaps_forest_edges():
    # A perturbation that changes which edges form the forest: token 3 switches from hanging on token 2 to hanging on
    # the prompt.  Bound still holds.
    rows = np.array([[[0.5, 0.2, 0.3, 0.0], [0.6, 0.0, 0.4, 0.0]]])  # 3 -> 2 at 0.6 vs 3 -> P at 0.4
    eps = 0.15
    moved = rows + np.array([[[0.0, 0.0, 0.0, 0.0], [-eps, 0.0, eps, 0.0]]])  # 3 -> P at 0.55, 3 -> 2 at 0.45
    a, b = mtopdiv(rows, 2), mtopdiv(moved, 2)
    assert a.parent[0, 1] == 0 and b.parent[0, 1] == 2
    assert abs(a.total[0] - b.total[0]) <= stability_bound(eps, 2) + 1e-12


# ------------------------------------------------------------------------------------------- token weights, parents
@pytest.mark.parametrize("seed", range(8))
def test_token_weights_and_parents(seed):
    rng = np.random.default_rng(400 + seed)
    n_prompt, n_resp, n_heads = int(rng.integers(1, 50)), int(rng.integers(1, 50)), 5
    att = causal_attention(rng, n_heads, n_prompt + n_resp, float(rng.choice([1.0, 4.0, 20.0])), 0.3)
    rows = att[:, n_prompt:, :]
    res = mtopdiv(rows, n_prompt)
    np.testing.assert_allclose(res.token_weights.sum(1), res.total, rtol=0, atol=1e-12)
    assert np.all(res.token_weights >= 0.0) and np.all(res.token_weights <= 1.0)
    for h in range(n_heads):
        dist = distance_matrix(full_from_rows(rows, n_prompt)[h], n_prompt)
        for r in range(n_resp):
            p = res.parent[h, r]
            assert 0 <= p < n_prompt + n_resp and p != n_prompt + r
            # the attaching edge exists in the graph with exactly that length
            assert abs(dist[n_prompt + r, p] - res.token_weights[h, r]) <= 1e-12
            # following parents reaches the prompt without cycles: it is a forest rooted in P
            seen, node = set(), n_prompt + r
            while node >= n_prompt:
                assert node not in seen
                seen.add(node)
                node = res.parent[h, node - n_prompt]


# --------------------------------------------------------------------------- dtypes, clipping, batching, validation
def test_float32_float16_and_clipping():
    rng = np.random.default_rng(500)
    n_prompt, n_resp = 9, 21
    att = causal_attention(rng, 4, n_prompt + n_resp, 4.0)
    rows = att[:, n_prompt:, :]
    ref = mtopdiv(rows, n_prompt)
    r32 = mtopdiv(rows.astype(np.float32), n_prompt)
    assert r32.total.dtype == np.float64
    np.testing.assert_allclose(r32.total, ref.total, rtol=0, atol=n_resp * 6e-8)
    r16 = mtopdiv(rows.astype(np.float16), n_prompt)
    np.testing.assert_allclose(r16.total, ref.total, rtol=0, atol=n_resp * 1e-3)
    # Weights a hair outside [0, 1] (float error) behave as if clipped.
    fuzzy = rows.copy()
    fuzzy[fuzzy == 0.0] = -1e-7
    fuzzy[0, 0, :] = 0.0
    fuzzy[0, 0, 0] = 1.0 + 1e-7
    clipped = np.clip(fuzzy, 0.0, 1.0)
    a, b = mtopdiv(fuzzy, n_prompt), mtopdiv(clipped, n_prompt)
    np.testing.assert_array_equal(a.total, b.total)
    assert a.token_weights[0, 0] == 0.0
    assert np.all(a.token_weights >= 0.0) and np.all(a.token_weights <= 1.0)


def test_heads_independent_and_chunking(monkeypatch):
    rng = np.random.default_rng(600)
    n_prompt, n_resp = 13, 27
    att = causal_attention(rng, 7, n_prompt + n_resp, 3.0, 0.2)
    rows = att[:, n_prompt:, :]
    batch = mtopdiv(rows, n_prompt)
    for h in range(7):
        single = mtopdiv(rows[h : h + 1], n_prompt)
        assert single.total[0] == batch.total[h]
        np.testing.assert_array_equal(single.parent[0], batch.parent[h])
    monkeypatch.setattr(topology, "_CHUNK_BYTES", 1)  # one head per chunk
    chunked = mtopdiv(rows, n_prompt)
    np.testing.assert_array_equal(chunked.token_weights, batch.token_weights)
    np.testing.assert_array_equal(mst_length(att, n_prompt).total, _mst_unchunked(att, n_prompt))


def _mst_unchunked(att, n_prompt):
    return np.array([mst_length(att[h : h + 1], n_prompt).total[0] for h in range(att.shape[0])])


def test_torch_tensor_input():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(700)
    att = causal_attention(rng, 2, 12, 3.0, dtype=np.float32)
    a = mtopdiv(torch.from_numpy(att[:, 5:, :]), 5)
    b = mtopdiv(att[:, 5:, :], 5)
    np.testing.assert_array_equal(a.total, b.total)


def test_validation_errors():
    rows = np.full((2, 3, 7), 0.1)
    with pytest.raises(ValueError, match="n_prompt"):
        mtopdiv(np.full((2, 3, 3), 0.1), 0)  # no prompt: MTop-Div(R, P) needs P non-empty
    with pytest.raises(ValueError, match="R = 0"):
        mtopdiv(np.zeros((2, 0, 4)), 4)
    with pytest.raises(ValueError, match="n_prompt"):
        mtopdiv(rows, 3)  # 3 + 3 != 7
    with pytest.raises(ValueError, match="shape"):
        mtopdiv(rows[0], 4)
    bad = rows.copy()
    bad[1, 2, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        mtopdiv(bad, 4)
    with pytest.raises(ValueError, match="n_prompt"):
        mst_length(np.zeros((1, 4, 4)), 4)
    with pytest.raises(ValueError, match="shape"):
        mst_length(np.zeros((1, 4, 5)))
    assert mtopdiv(np.zeros((0, 3, 7)), 4).total.shape == (0,)
    np.testing.assert_array_equal(mst_length(np.ones((3, 1, 1))).total, np.zeros(3))


# ------------------------------------------------------------------------------ MST length ablation (Sec. 4.4, Table 4)
@pytest.mark.parametrize("seed", range(10))
def test_mst_length_matches_ripser_and_scipy(seed):
    from scipy.sparse.csgraph import minimum_spanning_tree

    rng = np.random.default_rng(800 + seed)
    n = int(rng.integers(2, 40))
    n_prompt = int(rng.integers(0, n))
    att = causal_attention(rng, 3, n, float(rng.choice([0.5, 3.0])))
    res = mst_length(att, n_prompt)
    np.testing.assert_allclose(res.d, res.total / (n - n_prompt), rtol=1e-15)
    for h in range(3):
        dist = distance_matrix(att[h])  # no zeroing
        assert abs(res.total[h] - ripser_h0_deaths(dist).sum()) <= max(1e-6, n * F32_ULP_HALF)
        # scipy reads zeros as missing edges, so it is a valid reference only when every off-diagonal distance > 0
        off = dist[~np.eye(n, dtype=bool)]
        assert np.all(off > 0)
        assert abs(res.total[h] - minimum_spanning_tree(dist).sum()) <= 1e-9


@pytest.mark.parametrize("seed", range(6))
def test_mst_length_vs_mtopdiv(seed):
    # Zeroing the prompt block can only shorten the MST, and that shortened MST is MTop-Div:
    #   L_MST(R u P) >= MTop-Div >= L_MST(R u P) - L_MST(P)   (the second is Sec. 3.3).
    rng = np.random.default_rng(900 + seed)
    n_prompt, n_resp = int(rng.integers(1, 40)), int(rng.integers(1, 40))
    att = causal_attention(rng, 4, n_prompt + n_resp, float(rng.choice([1.0, 6.0])), 0.4)
    md = mtopdiv(att[:, n_prompt:, :], n_prompt).total
    full = mst_length(att).total
    prompt_only = mst_length(att[:, :n_prompt, :n_prompt]).total
    assert np.all(full >= md - 1e-12)
    assert np.all(md >= full - prompt_only - 1e-12)


def test_mst_length_scipy_would_be_wrong_with_zeros():
    # Tokens 0 and 1 at distance 0 (w_10 = 1): scipy drops that edge; ours and ripser keep it.
    from scipy.sparse.csgraph import minimum_spanning_tree

    full = np.array([[[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.3, 0.2, 0.5]]])
    dist = distance_matrix(full[0])
    ours = mst_length(full).total[0]
    assert abs(ours - 0.7) <= 1e-12  # edges 0-1 at 0 and 0-2 at 0.7
    assert abs(ours - ripser_h0_deaths(dist).sum()) <= 1e-6
    # scipy drops the zero-length edge 0-1 and must connect token 1 through 1-2 (0.8): 0.7 + 0.8, wrong.
    assert abs(minimum_spanning_tree(dist).sum() - 1.5) <= 1e-12
