"""Honest probabilities and rankings: Platt scaling that never saturates, AUROC on the raw score, and
out-of-fold calibration of supervised detectors, each checked against an independent computation."""

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedGroupKFold

from halwatch.detectors import create_detector
from halwatch.detectors.attention import mean_lookback
from halwatch.detectors.calibration import Calibrator, best_f1_threshold
from halwatch.eval.metrics import evaluate


def test_probabilities_of_a_separating_score_stay_inside_the_probe_bounds():
    """A raw score that separates the probe perfectly (as a 270-feature classifier's in-sample log-odds do) used to
    get a huge Platt slope and probabilities of exactly 1.0 for every test answer past the probe: ties. Platt's
    smoothed targets keep the slope finite, and probabilities stay within (N+ + 1)/(N+ + 2) and 1/(N- + 2)."""
    raw = np.r_[np.linspace(-30, -10, 40), np.linspace(10, 30, 60)]
    labels = np.r_[np.zeros(40, int), np.ones(60, int)]
    cal = Calibrator("platt").fit(raw, labels)
    test = np.array([35.0, 40.0, 60.0, 100.0, -100.0])
    probs = cal.transform(test)
    assert probs.max() <= 61 / 62 + 1e-12 and probs.min() >= 1 / 42 - 1e-12
    assert np.all((probs > 0) & (probs < 1))
    # the ranking keeps every distinct raw score apart, where probabilities may tie at the bounds
    assert len(np.unique(cal.ranking(test))) == len(test)


def test_auroc_ranks_by_the_raw_score_not_by_tied_probabilities():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 300)
    raw = rng.normal(2.0 * labels, 1.0) + 50.0  # far outside the probe below: old probabilities were all 1.0
    probe_raw, probe_y = rng.normal(0.5 * labels[:100], 0.01), labels[:100]
    cal = Calibrator("platt").fit(probe_raw, probe_y)
    probs = cal.transform(raw)
    assert len(np.unique(probs)) < 5  # clipped at the bound: probabilities cannot rank these answers
    row = evaluate(labels, probs, 0.5, cal.ranking(raw))
    assert row["auroc"] == pytest.approx(roc_auc_score(labels, raw))
    assert row["auroc"] > 0.8  # the score ranks them well; ranking by the tied probabilities would give 0.5


def test_a_reversed_platt_slope_reverses_the_ranking():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 2, 200)
    raw = rng.normal(-1.5 * labels, 1.0)  # anti-correlated with hallucination
    cal = Calibrator("platt").fit(raw, labels)
    assert cal.params["coef"] < 0
    np.testing.assert_array_equal(cal.ranking(raw), -raw)
    assert roc_auc_score(labels, cal.ranking(raw)) == pytest.approx(roc_auc_score(labels, cal.transform(raw)))


def test_a_supervised_score_is_never_turned_round():
    """A classifier's held-out scores that run against the labels (a small probe's chance) do not reverse it: the
    slope is set to 0, every probability is the probe's smoothed base rate, worked out here by hand, and the ranking
    is the method's own raw score. On today's main the TOHA random split (llama-2-13b-chat, seed 4) was turned
    round this way and scored 0.367 instead of 0.633."""
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 2, 200)
    raw = rng.normal(-1.5 * labels, 1.0)
    cal = Calibrator("platt").fit(raw, labels, oriented=True)
    n_pos, n_neg = labels.sum(), len(labels) - labels.sum()
    base = (n_pos * (n_pos + 1) / (n_pos + 2) + n_neg / (n_neg + 2)) / len(labels)  # mean of Platt's targets
    assert cal.params["coef"] == 0.0
    np.testing.assert_allclose(cal.transform(np.array([-5.0, 0.0, 5.0])), base, rtol=1e-12)
    np.testing.assert_array_equal(cal.ranking(raw), raw)
    # the same score, oriented by its own construction the right way, keeps its fitted slope
    assert Calibrator("platt").fit(-raw, labels, oriented=True).params["coef"] > 0


def test_lookback_lens_is_calibrated_out_of_fold(scorer, probe):
    """Lookback Lens's calibration and threshold are fitted on held-out scores: recomputed here with scikit-learn
    alone (the same folds, stratified and by source, a logistic regression per fold on the standardised time-mean
    lookback ratios, with the C that cross-validation chose; an answer whose context the cap cut scored in each of
    its windows, the lowest counting, as scoring does), they give the same Platt parameters and threshold."""
    lens = create_detector("lookback-lens", scorer)
    lens.fit(probe)
    assert lens.fitted_on["calibration"] == "out-of-fold, folds by source"
    signals = scorer.signals(probe, lens.request())
    x = mean_lookback(signals, scorer.model.all_heads())
    y = np.array([s.label for s in probe])
    held_out = np.zeros(len(y))
    groups = [s.source for s in probe]
    for train, test in StratifiedGroupKFold(5, shuffle=True, random_state=0).split(x, y, groups):
        mean, std = x[train].mean(0), x[train].std(0) + 1e-8
        lr = LogisticRegression(C=lens.model["C"], max_iter=10000, tol=1e-10).fit((x[train] - mean) / std,
                                                                                  y[train])
        held_out[test] = lr.decision_function((x[test] - mean) / std)
        for i in test:
            windows = scorer.encode_windows(probe[i])
            if len(windows) > 1:
                found = scorer.signals([w.sample for w in windows], lens.request(), views=windows)
                held_out[i] = lr.decision_function((mean_lookback(found, scorer.model.all_heads()) - mean) / std).min()
    assert lens.fitted_on["windowed"] > 0
    reference = Calibrator("platt").fit(held_out, y)
    for key in ("coef", "intercept", "mean", "std"):
        assert lens.calibrator.params[key] == pytest.approx(reference.params[key], rel=1e-3, abs=1e-3)
    assert lens.threshold == pytest.approx(best_f1_threshold(reference.transform(held_out), y), abs=1e-3)
    # in sample, 270 features separate 40 answers; out of fold they do not: the slope is that of held-out scores
    in_sample = lens.raw_scores(signals)
    assert roc_auc_score(y, in_sample) > roc_auc_score(y, held_out)
    assert lens.model["C"] in [float(c) for c in np.logspace(-4, 2, 7)]


def test_every_supervised_detector_can_be_fitted_again(scorer, probe):
    """A fitted detector fitted again on other data (TOHA and attention-ratio ask only for their chosen heads once
    fitted; a mapped Lookback Lens scores through its head map) gives what a fresh detector fitted on that data
    gives."""
    from halwatch.detectors.attention import LookbackLens

    first, second = probe[:10] + probe[20:30], probe[10:20] + probe[30:]
    for name in ("toha", "attention-ratio", "lookback-lens", "linear-probe"):
        det = create_detector(name, scorer).fit(first)
        if name == "lookback-lens":
            det = LookbackLens.mapped_from(det, scorer, first)
        det.fit(second)
        fresh = create_detector(name, scorer).fit(second)
        signals = scorer.signals(probe, fresh.request())
        np.testing.assert_allclose(det.scores_and_ranking(signals)[0], fresh.scores_and_ranking(signals)[0], atol=1e-9)
        assert getattr(det, "feature_map", None) is None


def test_a_share_is_not_estimated_from_too_few_answers_or_at_a_bound():
    """`calibrate --prior estimate` refuses what label shift cannot explain: fewer than 20 answers, or scores whose
    likelihood is highest with no (or only) hallucinated answers; a fair case gives an interval around the estimate."""
    from halwatch.detectors.calibration import estimated_share
    from halwatch.errors import InputError

    with pytest.raises(InputError, match="too few"):
        estimated_share(np.full(10, 0.5), 0.5)
    with pytest.raises(InputError, match="do not fit the training answers"):
        estimated_share(np.full(50, 0.3), 0.5)  # every answer less likely than the share assumed: q -> 0
    found = estimated_share(np.r_[np.full(30, 0.9), np.full(70, 0.1)], 0.5)
    assert 0.1 < found["interval"][0] <= found["estimate"] <= found["interval"][1] < 0.5
