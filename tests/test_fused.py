"""The fused detector: out-of-fold stacking (an answer's held-out inputs come from models that never saw it), the
length coefficient it reports, and its ablation switch."""

import numpy as np
import pytest

from halwatch.detectors import create_detector


@pytest.fixture(scope="module")
def fitted(scorer, probe):
    return create_detector("fused", scorer, C=1.0, token_l2=0.01, folds=4).fit(probe)


def test_held_out_inputs_are_out_of_fold(scorer, probe, fitted):
    """Every stacker input of an answer comes from models that never saw it: a family's column equals a logistic
    regression refitted here with scikit-learn on the other folds; and removing one answer's gold spans leaves its
    pooled token scores as they were (the token model that scored it never read them) while others move."""
    from dataclasses import replace

    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold

    y = np.array([s.label for s in probe])
    x = fitted.answer_features(scorer.signals(probe, fitted.request()))["lookback"]
    expected = np.zeros(len(y))
    for train, held in StratifiedKFold(4, shuffle=True, random_state=0).split(x, y):
        mean, std = x[train].mean(0), x[train].std(0) + 1e-8
        lr = LogisticRegression(C=1.0, max_iter=1000).fit((x[train] - mean) / std, y[train])
        expected[held] = lr.decision_function((x[held] - mean) / std)
    column = fitted.columns.index("lookback")
    np.testing.assert_allclose(fitted.held_out_inputs[:, column], expected, rtol=1e-4, atol=1e-4)

    k = next(i for i, s in enumerate(probe) if s.spans)
    changed = list(probe)
    changed[k] = replace(probe[k], spans=[])
    other = create_detector("fused", scorer, C=1.0, token_l2=0.01, folds=4).fit(changed)
    pooled = [fitted.columns.index(c) for c in ("token_max", "token_top", "token_mean")]
    np.testing.assert_allclose(other.held_out_inputs[k, pooled], fitted.held_out_inputs[k, pooled], atol=1e-5)
    assert not np.allclose(other.held_out_inputs[:, pooled], fitted.held_out_inputs[:, pooled], atol=1e-5)


def test_scores_spans_coefficients_and_ablation(scorer, probe, ragtruth_train, fitted):
    held_out = [s for s in ragtruth_train[300:400] if len(s.response) < 600][:4]
    probs = fitted.score(held_out)
    assert probs.shape == (4,) and np.all((probs > 0) & (probs < 1))
    coefficients = fitted.coefficients()
    assert set(coefficients) == {"lookback", "toha", "diag", "sink", "hidden", "uncertainty", "token_max",
                                 "token_top", "token_mean", "log_length"}
    for sample in held_out:
        for span in fitted.spans(sample):
            assert sample.response[span["start"]:span["end"]] == span["text"]
    tokens = fitted.token_scores(scorer.signals(held_out[:1], fitted.request()))[0]
    assert tokens.shape == (scorer.encode(held_out[0]).n_response,) and ((0 < tokens) & (tokens < 1)).all()
    lean = create_detector("fused", scorer, C=1.0, folds=3, drop=["tokens", "hidden"]).fit(probe)
    assert lean.token_model is None and lean.spans(held_out[0]) == []
    assert set(lean.coefficients()) == {"lookback", "toha", "diag", "sink", "uncertainty", "log_length"}
    with pytest.raises(ValueError, match="unknown signal families"):
        create_detector("fused", scorer, drop=["colour"])
