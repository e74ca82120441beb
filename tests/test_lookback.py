import numpy as np
import pytest

from halwatch.signals.lookback import lookback_ratios


def test_lookback_ratio_on_a_hand_built_matrix():
    # 3 prompt tokens, 2 response tokens, one head
    rows = np.array([[[0.2, 0.2, 0.2, 0.4, 0.0],     # response token 0: context mean 0.2, own 0.4
                      [0.1, 0.1, 0.4, 0.3, 0.1]]])   # response token 1: context mean 0.2, generated mean 0.2
    ratios = lookback_ratios(rows, n_prompt=3)
    np.testing.assert_allclose(ratios, [[0.2 / (0.2 + 0.4), 0.2 / (0.2 + 0.2)]])


def test_lookback_ratio_extremes_and_errors():
    only_context = np.array([[[0.5, 0.5, 0.0]]])
    only_self = np.array([[[0.0, 0.0, 1.0]]])
    assert lookback_ratios(only_context, 2)[0, 0] == 1.0
    assert lookback_ratios(only_self, 2)[0, 0] == 0.0
    with pytest.raises(ValueError):
        lookback_ratios(only_self, 1)


def test_window_means_by_hand():
    from halwatch.signals.lookback import window_means, window_starts

    values = np.array([[1.0, 2.0, 3.0, 4.0, 5.0], [0.0, 0.0, 1.0, 1.0, 1.0]])
    starts, x = window_means(values, window=2, stride=2)
    assert starts.tolist() == [0, 2, 3]  # the last window ends at the last token
    np.testing.assert_allclose(x, [[1.5, 0.0], [3.5, 1.0], [4.5, 1.0]])
    assert window_starts(3, 8, 4).tolist() == [0]  # shorter than a window: one window of everything
    np.testing.assert_allclose(window_means(values[:, :3], 8, 4)[1], [[2.0, 1 / 3]])
    with pytest.raises(ValueError):
        window_starts(5, 0, 1)


def test_span_scores_by_hand():
    from halwatch.eval.metrics import span_scores

    pred = [[{"start": 0, "end": 10}], []]
    gold = [[{"start": 5, "end": 15}], [{"start": 0, "end": 5}]]
    got = span_scores(pred, gold)
    assert got["span_precision"] == 5 / 10 and got["span_recall"] == 5 / 15
    assert got["span_f1"] == pytest.approx(2 * 0.5 * (1 / 3) / (0.5 + 1 / 3))
    assert span_scores([[]], [[]])["span_f1"] == 0.0


def test_lookback_features_alone_equal_those_of_the_shared_pass(smol, probe):
    """The lookback ratios a Lookback Lens gets from its own pass equal those of the one pass that also feeds
    TOHA and every other white-box detector."""
    from halwatch.detectors import create_detector
    from halwatch.scorer import Scorer
    from halwatch.signals import whitebox_request

    scorer = Scorer(model=smol, max_tokens=400, cache=None)
    lens, toha = create_detector("lookback-lens", scorer), create_detector("toha", scorer)
    alone = scorer.signals(probe[:2], lens.request())
    shared = scorer.signals(probe[:2], lens.request().merge(toha.request(), whitebox_request(smol)))
    heads = smol.all_heads()
    for a, b in zip(alone, shared):
        np.testing.assert_array_equal(a.head_values("lookback.ratio", heads), b.head_values("lookback.ratio", heads))
        assert "mtopdiv.d" in b.reduced and "mtopdiv.d" not in a.reduced


def test_lookback_lens_window_classifier_spans_and_save(scorer, probe, tmp_path):
    from halwatch.detectors import create_detector, load_detector
    from halwatch.eval.protocols import Bench

    lens = create_detector("lookback-lens", scorer, window=8, window_stride=4)
    lens.fit(probe)
    assert lens.window_model is not None and 0 < lens.window_threshold < 1  # RAGTruth has gold spans
    views = [scorer.encode(s) for s in probe]
    signals = scorer.signals(probe, lens.request(), views=views)
    x, y = lens.window_data(signals, views)
    assert x.shape == (len(y), len(scorer.model.all_heads())) and 0 < y.mean() < 1
    tokens = lens.token_scores(signals[:3])
    assert all(t.shape == (s.n_response,) and (0 <= t).all() and (t <= 1).all() for t, s in zip(tokens, signals))
    figures = Bench.span_metrics(lens, signals, views)
    assert {"span_f1", "span_trivial_f1", "window_auroc", "window_f1"} <= set(figures)
    assert figures["window_auroc"] > 0.6  # fitted and evaluated on the same windows: well above chance
    path = tmp_path / "lens.json"
    lens.save(path)
    again = load_detector(str(path), scorer=scorer)
    np.testing.assert_allclose(again.score_signals(signals), lens.score_signals(signals))
    assert again.spans_from(views[0], signals[0]) == lens.spans_from(views[0], signals[0])
    chunk = lens.continuation_scores(signals[:2], start=3)
    assert chunk.shape == (2,) and np.isfinite(chunk).all()


def test_mapped_lens_on_its_own_model_reproduces_the_source(scorer, probe):
    """A detector mapped onto the same model's heads (the map should come out as the identity) scores as the
    source does; the mapped artifact keeps the map and names the source model."""
    from scipy.stats import spearmanr

    from halwatch.detectors import create_detector
    from halwatch.detectors.attention import LookbackLens

    source = create_detector("lookback-lens", scorer).fit(probe)
    mapped = LookbackLens.mapped_from(source, scorer, probe, alpha=1e-3)
    coef = np.array(mapped.feature_map["coef"])
    assert coef.shape == (270, 270) and mapped.fitted_on["mapped_from"] == "smollm2-135m"
    signals = scorer.signals(probe, source.request())
    assert spearmanr(mapped.score_signals(signals), source.score_signals(signals))[0] > 0.99
    state = LookbackLens.from_dict(mapped.to_dict(), scorer=scorer)
    np.testing.assert_allclose(state.score_signals(signals), mapped.score_signals(signals))
