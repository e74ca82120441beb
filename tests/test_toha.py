import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from halwatch.detectors import create_detector, load_detector
from halwatch.detectors.heads import head_deltas, select_heads
from halwatch.detectors.toha import copy_head_scores
from halwatch.models.signal_types import SignalRequest
from halwatch.signals.topology import mtopdiv


def test_select_heads_follows_algorithm_1():
    rng = np.random.default_rng(0)
    labels = np.array([1] * 30 + [0] * 30)
    values = rng.random((60, 12))
    values[:30, 3] += 0.5   # a strongly separating head
    values[:30, 7] += 0.2   # a weaker one
    order, deltas, n_opt = select_heads(values, labels, n_max=5)
    np.testing.assert_allclose(deltas, values[:30].mean(0) - values[30:].mean(0))  # eq. 3
    assert list(order[:2]) == [3, 7]
    # brute force of lines 6-16: the first N with the highest AUROC of the running mean
    aurocs = [roc_auc_score(labels, values[:, order[:n]].mean(1)) for n in range(1, 6)]
    assert n_opt == int(np.argmax(aurocs)) + 1
    np.testing.assert_allclose(head_deltas(values, labels), deltas)


def test_select_heads_when_every_delta_is_negative_and_n_max_exceeds_the_heads():
    """Algorithm 1 sorts by Δ whatever its sign: with every head lower on hallucinated answers, the order is still
    by descending Δ (the least negative first), N_opt the first N with the best probe AUROC (below 0.5 here), and an
    N_max above the number of heads stops at the last head."""
    rng = np.random.default_rng(3)
    labels = np.array([1] * 25 + [0] * 25)
    values = rng.random((50, 4))
    values[:25] -= np.array([0.05, 0.4, 0.2, 0.1])  # Δ = -0.05, -0.4, -0.2, -0.1 (plus noise)
    order, deltas, n_opt = select_heads(values, labels, n_max=10)
    assert (deltas < 0).all() and list(order) == list(np.argsort(-deltas))
    assert order[0] == 0 and order[-1] == 1
    aurocs = [roc_auc_score(labels, values[:, order[:n]].mean(1)) for n in range(1, 5)]
    assert max(aurocs) < 0.5 and n_opt == int(np.argmax(aurocs)) + 1 and 1 <= n_opt <= 4


def test_toha_fit_score_spans_and_artifact(spans_of, scorer, probe, ragtruth_train, tmp_path):
    toha = create_detector("toha", scorer=scorer, n_max=10)
    toha.fit(probe)
    assert 1 <= len(toha.heads) <= 10
    # the chosen heads, recomputed with NumPy and scikit-learn from the probe's per-head divergences: the top N of
    # Δ (eq. 3) with N the first of the best running-mean AUROCs (Algorithm 1)
    heads = scorer.model.all_heads()
    d = np.stack([s.head_values("mtopdiv.d", heads) for s in scorer.signals(probe, toha.fit_request())])
    y = np.array([s.label for s in probe])
    by_delta = np.argsort(-(d[y == 1].mean(0) - d[y == 0].mean(0)), kind="stable")
    aurocs = [roc_auc_score(y, d[:, by_delta[:n]].mean(1)) for n in range(1, 11)]
    assert toha.heads == [heads[i] for i in by_delta[: int(np.argmax(aurocs)) + 1]]
    # the score is the mean eq.-3 divergence of the chosen heads, checked against the topology module
    sample = probe[0]
    view = scorer.encode(sample)
    rows = scorer.signals([sample], SignalRequest(heads=tuple(toha.heads), keep_attention=True))[0].attention
    expected = mtopdiv(rows, view.n_prompt).d.mean()
    assert toha.raw_scores(scorer.signals([sample], toha.request()))[0] == pytest.approx(expected, abs=1e-6)
    held_out = [s for s in ragtruth_train[300:360] if len(s.response) < 700][:5]
    probs = toha.score(held_out)
    assert np.all((probs >= 0) & (probs <= 1))
    spans = spans_of(toha, held_out[0])
    for span in spans:
        assert held_out[0].response[span["start"] : span["end"]] == span["text"]
    toha.save(tmp_path / "toha.json")
    again = load_detector(str(tmp_path / "toha.json"), scorer=scorer)
    assert again.heads == toha.heads
    np.testing.assert_allclose(again.score(held_out), probs)
    assert again.request().heads == tuple(sorted(toha.heads))  # at inference only the chosen heads are captured


def test_copy_heads_are_found_without_labels(smol, scorer, probe):
    scores = copy_head_scores(smol, n_sequences=2)
    assert scores.shape == (30, 9) and np.all((scores >= 0) & (scores <= 1))
    # real induction heads attend strongly to the token after the previous occurrence; the median head does not
    assert scores.max() > 0.3 > np.median(scores)
    det = create_detector("toha-copy", scorer=scorer).fit(probe)
    assert len(det.heads) == 4
    assert [scores[h] for h in det.heads] == sorted((scores[h] for h in det.heads), reverse=True)


def test_mst_ablation_uses_the_complete_graph(spans_of, smol, signal_cache, probe):
    from halwatch.scorer import Scorer
    from halwatch.signals.topology import mst_length

    scorer = Scorer(model=smol, max_tokens=256, cache=signal_cache)  # complete graphs of all heads: keep them small
    short = [s for s in probe if len(s.response) < 400]
    det = create_detector("toha", scorer=scorer, divergence="mst", n_max=3)
    det.fit(short[:4] + short[-4:])
    assert det.request().attention_from == "all" and spans_of(det, probe[0]) == []
    sample = short[5]
    rows = scorer.signals([sample], SignalRequest(heads=tuple(det.heads), attention_from="all",
                                                  keep_attention=True))[0].attention
    n_prompt = scorer.encode(sample).n_prompt
    expected = mst_length(rows, n_prompt).d.mean()
    assert det.raw_scores(scorer.signals([sample], det.request()))[0] == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match="divergence must be"):
        create_detector("toha", divergence="nope")


def test_mtopdiv_equals_ripser_on_real_attention_maps(scorer, probe):
    ripser = pytest.importorskip("ripser").ripser
    sample = probe[3]
    heads = ((0, 0), (10, 4), (19, 0), (21, 6), (29, 8))
    sig = scorer.signals([sample], SignalRequest(heads=heads, keep_attention=True))[0]
    ours = mtopdiv(sig.attention, sig.n_prompt).total
    n = sig.n_prompt + sig.n_response
    for h, rows in enumerate(sig.attention.astype(np.float64)):
        w = np.zeros((n, n))
        w[sig.n_prompt :] = rows
        d = 1.0 - np.maximum(w, w.T)
        d[: sig.n_prompt, : sig.n_prompt] = 0.0
        np.fill_diagonal(d, 0.0)
        bars = ripser(d, distance_matrix=True, maxdim=0)["dgms"][0]
        finite = np.isfinite(bars[:, 1])
        # ripser works in float32: allow its rounding over |R| bars
        assert ours[h] == pytest.approx(float(np.sum(bars[finite, 1] - bars[finite, 0])), abs=max(1e-6, n * 3e-8))
