"""halwatch's one logistic regression, its folds by source, the decision rules and the conformal threshold of
`halwatch calibrate`, each against an independent computation."""

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression

from halwatch import InputError
from halwatch.detectors import linear
from halwatch.detectors.calibration import Calibrator, conformal_threshold
from halwatch.detectors.operating import fpr_threshold, parse_decision
from halwatch.eval.metrics import evaluate, expected_calibration_error


def _data(seed=0, n=400, d=6):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)) * rng.uniform(0.5, 5, d) + rng.normal(size=d)
    y = (x @ rng.normal(size=d) / 3 + rng.logistic(size=n) > 0).astype(int)
    return x, y


@pytest.mark.parametrize("C", [0.01, 1.0, 100.0])
def test_fit_equals_scikit_learn_on_standardised_features(C):
    x, y = _data()
    w = np.random.default_rng(1).uniform(0.2, 3, len(y))
    mean, std = x.mean(0), x.std(0)
    for weights in (None, w):
        ref = LogisticRegression(C=C, max_iter=10000, tol=1e-10).fit((x - mean) / std, y, sample_weight=weights)
        model = linear.fit(x, y, C=C, weights=weights)
        np.testing.assert_allclose(linear.coefficients(model), ref.coef_[0], rtol=1e-3, atol=1e-4)
        np.testing.assert_allclose(linear.logodds(model, x), ref.decision_function((x - mean) / std), atol=1e-3)


def test_cv_picks_from_the_grid_and_groups_stay_whole():
    x, y = _data(2)
    groups = np.arange(len(y)) // 7
    for train, held in linear.folds_of(y, 5, groups):
        assert not set(groups[train]) & set(groups[held])
    model = linear.fit(x, y, C="cv", groups=groups)
    assert model["C"] in linear.C_GRID
    # a model written before packing (lists) scores the same
    legacy = {k: (linear.unpack(v).tolist() if isinstance(v, dict) else v) for k, v in model.items()}
    np.testing.assert_allclose(linear.logodds(legacy, x), linear.logodds(model, x), atol=1e-5)


def test_platt_scaling_equals_a_weighted_scikit_learn_fit():
    """Platt's soft targets as two weighted copies of each answer in scikit-learn (the old implementation)."""
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 2, 300)
    raw = rng.normal(1.2 * labels, 1.0)
    cal = Calibrator("platt").fit(raw, labels)
    n_pos, n_neg = labels.sum(), len(labels) - labels.sum()
    target = np.where(labels == 1, (n_pos + 1) / (n_pos + 2), 1 / (n_neg + 2))
    z = ((raw - raw.mean()) / raw.std())[:, None]
    ref = LogisticRegression(C=1e4, max_iter=10000, tol=1e-10).fit(
        np.vstack([z, z]), np.r_[np.ones(len(z)), np.zeros(len(z))], sample_weight=np.r_[target, 1 - target])
    assert cal.params["coef"] == pytest.approx(ref.coef_[0, 0], rel=1e-3)
    assert cal.params["intercept"] == pytest.approx(ref.intercept_[0], abs=1e-3)
    assert cal.params["prior"] == pytest.approx(labels.mean())


def test_a_prior_moves_the_log_odds_and_not_the_order():
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 2, 300)
    raw = rng.normal(labels, 1.0)
    plain = Calibrator("platt").fit(raw, labels)
    shifted = Calibrator("platt").fit(raw, labels, prior=0.1)
    logit = lambda p: np.log(p / (1 - p))  # noqa: E731
    inside = (plain.transform(raw) > plain.params["p_min"]) & (plain.transform(raw) < plain.params["p_max"])
    delta = logit(shifted.transform(raw[inside])) - logit(plain.transform(raw[inside]))
    expected = logit(0.1) - logit(labels.mean())
    np.testing.assert_allclose(delta[(shifted.transform(raw[inside]) > shifted.params["p_min"])], expected,
                               atol=1e-9)
    assert shifted.params["prior"] == 0.1 and shifted.params["rate"] == pytest.approx(labels.mean())


def test_conformal_threshold_holds_the_rate_over_calibration_sets():
    """Simulated: 4,000 calibration sets of 49 grounded scores; each threshold's false-positive rate on fresh
    grounded scores of the same distribution averages at most the target, and the bound is exact for continuous
    scores."""
    rng = np.random.default_rng(5)
    rates = []
    for _ in range(4000):
        threshold, terms = conformal_threshold(rng.normal(size=49), 0.1)
        rates.append(np.mean(rng.normal(size=400) >= threshold))
    assert terms["k"] == 45 and terms["bound"] == pytest.approx(5 / 50)
    assert np.mean(rates) == pytest.approx(terms["bound"], abs=0.006)
    assert np.quantile(rates, 0.9) == pytest.approx(terms["fpr_90"], abs=0.02)
    with pytest.raises(InputError, match="at least 19 are needed"):
        conformal_threshold(np.arange(10.0), 0.05)


def test_decision_rules():
    probs = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95])
    labels = np.array([0, 0, 0, 0, 0, 1, 0, 1, 1, 1])
    t = fpr_threshold(probs, labels, 0.2)  # 6 grounded answers: at most one may be flagged
    assert ((probs >= t) & (labels == 0)).sum() == 1 and ((probs >= t - 0.11) & (labels == 0)).sum() == 2
    assert parse_decision("f1") == ("f1", None) and parse_decision("fpr=0.05") == ("fpr", 0.05)
    assert parse_decision("conformal fpr=0.1") == ("fpr", 0.1) and parse_decision("mean-fpr=0.2") == ("mean-fpr", 0.2)
    for bad in ("fpr=2", "max-fpr=0.1", "mean-fpr"):
        with pytest.raises(ValueError, match="'f1', 'fpr=A' or 'mean-fpr=A'"):
            parse_decision(bad)


def test_mean_fpr_threshold_weighs_each_dataset_the_same():
    """Against a brute-force scan: the lowest threshold among midpoints of the scores whose mean over datasets of
    the per-dataset false-positive rate is at most the target. A large set of low-scoring grounded answers (short
    answers) pulls the pooled threshold down; the mean rule holds the small set's rate too."""
    rng = np.random.default_rng(3)
    probs = np.concatenate([rng.uniform(0, 0.5, 300), rng.uniform(0.3, 1, 40), rng.uniform(0.5, 1, 60)])
    labels = np.concatenate([np.zeros(300), np.zeros(40), np.ones(60)]).astype(int)
    strata = np.array(["short"] * 300 + ["long"] * 100)
    grounded = np.sort(probs[labels == 0])
    candidates = np.concatenate([[grounded[0]], (grounded[1:] + grounded[:-1]) / 2, [np.nextafter(grounded[-1], 1)]])

    def mean_fpr(t):
        return np.mean([(probs[(strata == s) & (labels == 0)] >= t).mean() for s in ("short", "long")])

    for target in (0.05, 0.1, 0.2, 0.3):
        expected = min(t for t in candidates if mean_fpr(t) <= target)
        t = fpr_threshold(probs, labels, target, strata)
        assert mean_fpr(t) <= target and mean_fpr(t) == pytest.approx(mean_fpr(expected))
        assert t == pytest.approx(expected)
    pooled, mean = fpr_threshold(probs, labels, 0.1), fpr_threshold(probs, labels, 0.1, strata)
    long_grounded = probs[(strata == "long") & (labels == 0)]
    assert (long_grounded >= pooled).mean() > 0.3 and (long_grounded >= mean).mean() <= 0.2


def test_operating_point_and_calibration_error():
    labels = np.array([0, 0, 0, 1, 1, 0, 1, 1])
    probs = np.array([0.05, 0.15, 0.55, 0.65, 0.95, 0.95, 0.25, 0.85])
    row = evaluate(labels, probs, 0.5)
    assert row["fpr"] == pytest.approx(2 / 4) and row["tpr"] == pytest.approx(3 / 4)
    # by hand: bins [0,.1) {0.05:0}, [.1,.2) {0.15:0}, [.2,.3) {0.25:1}, [.5,.6) {0.55:0}, [.6,.7) {0.65:1},
    # [.8,.9) {0.85:1}, [.9,1] {0.95:1, 0.95:0}
    by_hand = (0.05 + 0.15 + 0.75 + 0.55 + 0.35 + 0.15 + 2 * 0.45) / 8
    assert expected_calibration_error(labels, probs) == pytest.approx(by_hand)
    assert row["ece"] == pytest.approx(by_hand)
