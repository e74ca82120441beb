import json

import numpy as np
import pytest
from sklearn.metrics import f1_score

from halwatch import HalwatchError, InputError
from halwatch.detectors import DETECTORS, create_detector, load_detector, shipped_artifacts
from halwatch.detectors.calibration import Calibrator, best_f1_threshold
from halwatch.scorer import Scorer


def test_best_f1_threshold_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(50):
        y = rng.integers(0, 2, 40)
        s = np.round(rng.random(40) + 0.3 * y, 2)  # ties included
        t = best_f1_threshold(s, y)
        best = max(f1_score(y, s >= c, zero_division=0) for c in np.unique(s))
        assert f1_score(y, s >= t, zero_division=0) == pytest.approx(best)


@pytest.mark.parametrize("method", ["platt", "isotonic"])
def test_calibration_is_monotone_probability(method):
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 200)
    raw = rng.normal(y, 1.0)
    cal = Calibrator(method).fit(raw, y)
    p = cal.transform(np.sort(raw))
    assert np.all((p > 0) & (p < 1)) and np.all(np.diff(p) >= -1e-12)
    back = Calibrator.from_dict(json.loads(json.dumps(cal.to_dict())))
    np.testing.assert_allclose(back.transform(raw), cal.transform(raw))
    with pytest.raises(InputError, match="both hallucinated"):
        Calibrator(method).fit(raw, np.zeros_like(y))


#: Detectors whose signals the shared white-box pass does not hold: tested on a smaller probe.
EXPENSIVE = {"lrp4rag", "toha-mst", "polygraph", "ln-entropy", "eigenscore", "selfcheck-ngram", "selfcheck-entail",
             "semantic-entropy"}


# LRP4RAG's contract (fit, score, the threshold at its classifier's own boundary, spans, reload) is tested with each of
# its classifiers on SQuAD-built answers of short passages in test_lrp4rag.py: its relevance pass is the dearest. The
# routed detector is fused parts, one per task, each with its own calibration: test_routed.py. The adapter trains the
# scoring model's layers (five folds and one more): test_adapter.py fits it on eight short answers
@pytest.mark.parametrize("name", sorted(set(DETECTORS) - {"lrp4rag", "routed", "adapter"}))
def test_baseline_contract_fit_score_spans_save_load(spans_of, name, scorer, probe, ragtruth_train, short_answers,
                                                     tmp_path):
    small = {"n_samples": 2, "max_new_tokens": 6}  # the sampling baselines: few, short samples keep this quick
    if name in EXPENSIVE:  # a pass of their own (relevance, every token's rows, sampling): 4 + 4 SQuAD-built
        probe, held_out = short_answers  # answers of short passages, and 2 held out (as test_lrp4rag.py's)
    else:  # answers whose context fits the 512-token cap: one view each (longer ones are windowed, test_windows.py)
        held_out = [s for s in ragtruth_train[200:260] if len(s.response) < 800 and not scorer.encode(s).cut_chars][:6]
    det = create_detector(name, scorer=scorer, **{k: v for k, v in small.items()
                                                  if k in DETECTORS[name].setting_names()})
    with pytest.raises(HalwatchError, match="not fitted"):
        det.score(probe[:1])
    det.fit(probe)
    assert det.identity["scoring_model"] == "smollm2-135m" and det.identity["input_mode"] == "raw"
    assert det.identity["dtype"] == "float32"  # the artifact records the precision it was fitted in
    probs = det.score(held_out)
    assert probs.shape == (len(held_out),) and np.all((probs >= 0) & (probs <= 1))
    # the raw score is what the paper defines, and the calibration is monotone in it
    signals = scorer.signals(held_out, det.request())
    raw = det.raw_scores(signals)
    if name == "perplexity":
        np.testing.assert_allclose(raw, [-np.mean(s.logprobs) for s in signals], rtol=1e-6)
    elif name == "max-entropy":
        np.testing.assert_allclose(raw, [np.max(s.entropy) for s in signals], rtol=1e-6)
    # calibration is monotone: probabilities never decrease along the ranking score (the raw score, reversed where
    # the probe data gave it a negative Platt slope), and never reach 0 or 1
    probs2, ranking = det.scores_and_ranking(signals)
    np.testing.assert_allclose(probs2, probs)
    slope = det.calibrator.params.get("coef", 1.0)
    np.testing.assert_allclose(ranking, raw * (np.sign(slope) or 1.0))
    assert np.all(np.diff(probs[np.argsort(ranking, kind="stable")]) >= -1e-12)
    assert np.all((probs > 0) & (probs < 1))
    # unsupervised scores are calibrated in sample, supervised methods out of fold (tested in test_calibration.py)
    # (folds by source: the probe's RAGTruth answers carry their source ids)
    assert det.fitted_on["calibration"] == ("out-of-fold, folds by source" if det.supervised
                                            else "in-sample (unsupervised score)")
    # the threshold was fitted on the probe data: for an unsupervised score it is the best-F1 cut of the probe
    # probabilities
    # the views it was fitted on (no windows)
    probe_probs = det.scores_and_ranking(scorer.signals(probe, det.request()))[0]
    labels = [s.label for s in probe]
    if not det.supervised:
        assert f1_score(labels, probe_probs >= det.threshold) == pytest.approx(
            max(f1_score(labels, probe_probs >= c) for c in np.unique(probe_probs)))
    for sample in held_out[:2]:
        for span in spans_of(det, sample):
            assert sample.response[span["start"] : span["end"]] == span["text"] and span["text"].strip()
    path = tmp_path / f"{name}.json"
    det.save(path)
    again = load_detector(str(path), scorer=scorer)
    np.testing.assert_allclose(again.score(held_out), probs)
    assert spans_of(again, held_out[0]) == spans_of(det, held_out[0])


def test_artifact_refuses_another_input_mode(scorer, smol, probe, tmp_path, signal_cache):
    det = create_detector("max-entropy", scorer=scorer).fit(probe)
    det.save(tmp_path / "a.json")
    chat = Scorer(model=smol, input_mode="chat", max_tokens=512, cache=signal_cache)
    with pytest.raises(HalwatchError, match="input_mode=raw"):
        load_detector(str(tmp_path / "a.json"), scorer=chat)


def test_fit_needs_labels_and_both_classes(scorer, probe):
    det = create_detector("perplexity", scorer=scorer)
    with pytest.raises(InputError, match="both hallucinated"):
        det.fit(probe[:3], labels=[1, 1, 1])


def test_unknown_detector_and_bad_artifact(tmp_path):
    with pytest.raises(HalwatchError, match="unknown detector"):
        create_detector("nope")
    with pytest.raises(HalwatchError, match=r"no shipped artifact of that name \(shipped: default, lookback-lens, "):
        load_detector("no-such-detector")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(HalwatchError, match="not a readable detector artifact"):
        load_detector(str(bad))


def test_shipped_artifacts_load_and_name_their_data():
    shipped = shipped_artifacts()
    assert {"default", "toha", "toha-chat", "lookback-lens", "lookback-lens-chat", "perplexity", "max-entropy",
            "mean-entropy"} <= set(shipped)
    default = load_detector("default")
    assert default.name == "routed" and default.fitted_on["n"] > 2000  # RAGTruth QA train, all three generators
    assert set(default.parts) == {"qa", "dialogue", "summary", "data2text"}
    for task, part in default.parts.items():
        # data-to-text's part is RotoWire's 284 train and dev sentences (fit --into, docs/scoring.md)
        assert "log_length" in part.coefficients() and part.fitted_on["n"] >= (250 if task == "data2text" else 1000)
        # a token model where the task's answers have span labels (BEGIN's and FaithDial's replies have none)
        assert (part.token_model is None) == (task == "dialogue"), task
    assert len(load_detector("toha").heads) <= load_detector("toha").settings["n_max"]
    for name in shipped:
        det = load_detector(name)
        assert det.identity["scoring_model"] == "smollm2-135m" and "ragtruth" in det.fitted_on["data"].lower()
        thresholds = det.thresholds.values() if name == "default" else [det.threshold]
        assert det.fitted_on["n"] >= 100 and all(0 < t < 1 for t in thresholds)
