"""The fused detector: out-of-fold stacking by source (an answer's held-out inputs come from models that never saw
it or any answer to its source), the length coefficient it reports, its ablation switch, the lexical support it
reads, and its distance from the training data."""

import numpy as np
import pytest

from halwatch.detectors import create_detector
from halwatch.detectors.ood import WEAK_AUROC, OODReference


@pytest.fixture(scope="module")
def fitted(scorer, probe):
    return create_detector("fused", scorer, C=1.0, token_C=1e-3, folds=4).fit(probe)


def test_held_out_inputs_are_out_of_fold(scorer, probe, fitted):
    """Every stacker input of an answer comes from models that never saw it: a family's column equals a logistic
    regression refitted here with scikit-learn on the other folds (stratified folds by source); and removing one
    answer's gold spans leaves its pooled token scores as they were (the token model that scored it never read
    them) while others move."""
    from dataclasses import replace

    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedGroupKFold

    y = np.array([s.label for s in probe])
    views = [scorer.encode(s) for s in probe]
    signals = scorer.signals(probe, fitted.fit_request(), views=views)
    x = fitted.answer_features(signals)["lookback"]
    expected = np.zeros(len(y))
    groups = [s.source for s in probe]
    for train, held in StratifiedGroupKFold(4, shuffle=True, random_state=0).split(x, y, groups):
        mean, std = x[train].mean(0), x[train].std(0) + 1e-8
        lr = LogisticRegression(C=1.0, max_iter=10000, tol=1e-10).fit((x[train] - mean) / std, y[train])
        expected[held] = lr.decision_function((x[held] - mean) / std)
    def held_out_inputs(samples, views):  # what fit_signals fits the operating point and the OOD reference on
        det = create_detector("fused", scorer, C=1.0, token_C=1e-3, folds=4)
        held = det.fit_out_of_fold(signals, np.array([s.label for s in samples]), views, np.array(groups))
        return held.inputs

    inputs = held_out_inputs(probe, views)
    column = fitted.columns.index("lookback")
    np.testing.assert_allclose(inputs[:, column], expected, rtol=1e-3, atol=1e-3)

    k = next(i for i, s in enumerate(probe) if s.spans)
    changed = list(probe)
    changed[k] = replace(probe[k], spans=[])
    other = held_out_inputs(changed, [scorer.encode(s) for s in changed])
    pooled = [fitted.columns.index(c) for c in ("token_max", "token_top", "token_mean")]
    np.testing.assert_allclose(other[k, pooled], inputs[k, pooled], atol=1e-5)
    assert not np.allclose(other[:, pooled], inputs[:, pooled], atol=1e-5)
    # (those are each answer's one view; its calibration read the long ones in their windows, as scoring does)
    assert fitted.fitted_on["windowed"] == sum(len(scorer.encode_windows(s)) > 1 for s in probe) > 0


def test_scores_spans_coefficients_and_ablation(spans_of, scorer, probe, ragtruth_train, fitted):
    held_out = [s for s in ragtruth_train[300:400] if len(s.response) < 600][:4]
    probs = fitted.score(held_out)
    assert probs.shape == (4,) and np.all((probs > 0) & (probs < 1))
    coefficients = fitted.coefficients()
    assert set(coefficients) == {"lookback", "toha", "diag", "hidden", "uncertainty", "support", "token_max",
                                 "token_top", "token_mean", "log_length"}
    for sample in held_out:
        for span in spans_of(fitted, sample):
            assert sample.response[span["start"]:span["end"]] == span["text"]
    tokens = fitted.token_scores(scorer.signals(held_out[:1], fitted.request()))[0]
    assert tokens.shape == (scorer.encode(held_out[0]).n_response,) and ((0 < tokens) & (tokens < 1)).all()
    lean = create_detector("fused", scorer, C=1.0, folds=3, drop=["tokens", "hidden"]).fit(probe)
    assert lean.token_model is None and spans_of(lean, held_out[0]) == []
    assert set(lean.coefficients()) == {"lookback", "toha", "diag", "uncertainty", "support", "log_length"}
    with pytest.raises(ValueError, match="unknown signal families"):
        create_detector("fused", scorer, drop=["colour"])


def test_lexical_support_reads_the_context():
    """The support flags of each token, checked by hand on an answer with one made-up year and one made-up name."""
    from halwatch.signals import support

    context = "The Eiffel Tower in Paris was completed in 1889 and was designed by the company of Gustave Eiffel."
    response = "The Eiffel Tower was completed in 1925 and was designed by Napoleon Bonaparte."
    spans, flags = support.word_flags(context, response)
    words = [response[a:b] for a, b in spans]
    novel = {w for w, f in zip(words, flags) if f[0]}
    assert novel == {"1925", "Napoleon", "Bonaparte"}
    assert {w for w, f in zip(words, flags) if f[3]} == {"1925"}  # the number absent from the context
    assert {w for w, f in zip(words, flags) if f[4]} == {"Napoleon", "Bonaparte"}  # capitalised and absent
    answer = dict(zip(support.ANSWER_FEATURES, support.answer_features(context, response)))
    content = [w for w in words if w.lower() not in support.STOPWORDS]
    assert answer["novel_word_share"] == pytest.approx(3 / len(content))
    assert answer["log_longest_novel_run"] == pytest.approx(np.log1p(2))  # "Napoleon Bonaparte"
    grounded = support.answer_features(context, "The Eiffel Tower was completed in 1889.")
    assert grounded[0] == 0 and grounded[6] == 0 and grounded[7] == 0


def test_distance_from_the_training_data(scorer, probe, fitted):
    """Training answers lie inside the recorded distances; an answer whose inputs are pushed far from them is
    reported as extrapolated."""
    signals = scorer.signals(probe, fitted.request())
    inputs = np.asarray(fitted.ood_inputs(signals))
    found = fitted.reference.of(inputs)
    assert len(found) == len(probe) and all(0 <= f["percentile"] <= 1 for f in found)
    far = fitted.reference.of(inputs[:1] + 50 * np.array(fitted.ood_reference["std"]))[0]
    assert far["extrapolated"] and far["percentile"] == 1.0 and far["distance"] > 40
    verdict = fitted.verdicts([scorer.encode(probe[0])], signals[:1])[0]
    assert set(verdict["ood"]) == {"distance", "percentile", "extrapolated", "weak", "held_out_auroc"}
    # the held-out AUROC of its training answers, as the fit's own figures give it: above chance on the probe
    auroc = verdict["ood"]["held_out_auroc"]
    assert 0.5 < auroc <= 1 and verdict["ood"]["weak"] == (auroc < WEAK_AUROC)
    weak = OODReference(fitted.reference.mean, fitted.reference.std, fitted.reference.distances, 0.61)
    again = OODReference.from_dict(weak.to_dict())
    assert again.of(inputs[:1])[0]["weak"] and again.held_out_auroc == 0.61


def test_copy_attention_widens_the_token_model_and_survives_a_reload(scorer, short_answers, tmp_path):
    """``copy=true``: the pass adds every head's copy attention (the reducer is checked against eager maps in
    test_forward.py) and each token's features gain exactly that block; a detector fitted so reloads from its
    artifact with the setting and scores as before; a value that is not a boolean is refused."""
    from halwatch.detectors import load_detector
    from halwatch.models.forward import whitebox_request

    fit, held_out = short_answers
    plain = create_detector("fused", scorer, folds=2)
    copying = create_detector("fused", scorer, folds=2, copy=True)
    assert "copy" not in plain.settings and plain.request() == whitebox_request(scorer.model)
    assert copying.request().covers(plain.request()) and "copy" in copying.request().reducers
    sig = scorer.signals(held_out[:1], copying.request())[0]
    heads = scorer.model.all_heads()
    wide, narrow = copying.token_features(sig), plain.token_features(sig)
    assert wide.shape == (sig.n_response, narrow.shape[1] + len(heads))
    np.testing.assert_array_equal(wide[:, :narrow.shape[1]], narrow)
    np.testing.assert_allclose(wide[:, narrow.shape[1]:], sig.head_values("copy.mass", heads).T, rtol=1e-6)

    copying.fit(fit)
    copying.save(tmp_path / "copy.json")
    again = load_detector(str(tmp_path / "copy.json"), scorer=scorer)
    assert again.settings["copy"] is True
    np.testing.assert_allclose(again.score(held_out), copying.score(held_out), atol=1e-6)
    for name in ("copy", "balance"):  # "false" from a file must not turn a setting on
        with pytest.raises(ValueError, match=f"{name}: true or false"):
            create_detector("fused", scorer, **{name: "false"})


def test_balance_weighs_labels_within_each_dataset_and_with_datasets_the_sets_too():
    from types import SimpleNamespace

    from halwatch.detectors.fused import balanced_weights

    # 6 answers of a large set (4 hallucinated, 2 grounded) and 2 of a small one (1 and 1)
    names = ["big"] * 6 + ["small"] * 2
    labels = [1, 1, 1, 1, 0, 0, 1, 0]
    views = [SimpleNamespace(sample=SimpleNamespace(meta={"dataset": n})) for n in names]
    # by hand: within a set each label carries half of the set's weight
    within = balanced_weights(labels, views)
    np.testing.assert_allclose(within, [0.75] * 4 + [1.5] * 2 + [1.0, 1.0])
    # each set carries 8 / 2 = 4 in all, split half and half between its labels
    sets = balanced_weights(labels, views, sets=True)
    np.testing.assert_allclose(sets, [0.5] * 4 + [1.0] * 2 + [2.0, 2.0])
    assert sets.sum() == pytest.approx(len(labels))
    assert create_detector("fused", None, balance="datasets").settings["balance"] == "datasets"
    with pytest.raises(ValueError, match="balance: true or false"):
        create_detector("fused", None, balance="sets")
