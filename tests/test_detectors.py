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
    assert np.all((p >= 0) & (p <= 1)) and np.all(np.diff(p) >= -1e-12)
    back = Calibrator.from_dict(json.loads(json.dumps(cal.to_dict())))
    np.testing.assert_allclose(back.transform(raw), cal.transform(raw))
    with pytest.raises(InputError, match="both hallucinated"):
        Calibrator(method).fit(raw, np.zeros_like(y))


@pytest.mark.parametrize("name", sorted(DETECTORS))
def test_baseline_contract_fit_score_spans_save_load(name, scorer, probe, ragtruth_train, tmp_path):
    small = {"n_samples": 2, "max_new_tokens": 6}  # the sampling baselines: few, short samples keep this quick
    if name == "lrp4rag":  # its relevance pass costs seconds per answer: 6 + 6 probe answers (test_lrp4rag.py has more)
        probe = probe[:6] + probe[20:26]
    det = create_detector(name, scorer=scorer, **{k: v for k, v in small.items()
                                                  if k in DETECTORS[name].setting_names()})
    with pytest.raises(HalwatchError, match="not fitted"):
        det.score(probe[:1])
    det.fit(probe)
    assert det.identity["scoring_model"] == "smollm2-135m" and det.identity["input_mode"] == "raw"
    held_out = [s for s in ragtruth_train[200:260] if len(s.response) < 800][:6]
    probs = det.score(held_out)
    assert probs.shape == (len(held_out),) and np.all((probs >= 0) & (probs <= 1))
    # the raw score is what the paper defines, and the calibration is monotone in it
    signals = scorer.signals(held_out, det.request())
    raw = det.raw_scores(signals)
    if name == "perplexity":
        np.testing.assert_allclose(raw, [-np.mean(s.logprobs) for s in signals], rtol=1e-6)
    elif name == "max-entropy":
        np.testing.assert_allclose(raw, [np.max(s.entropy) for s in signals], rtol=1e-6)
    # calibration is monotone: the same order as the raw score, or the reverse where the probe data gave the raw
    # score a negative Platt slope (recorded in the artifact)
    slope = det.calibrator.params["coef"]
    assert np.array_equal(np.argsort(raw * np.sign(slope), kind="stable"), np.argsort(probs, kind="stable"))
    # the threshold was fitted on the probe data: it is the best-F1 cut of the probe probabilities (LRP4RAG's is its
    # classifier's own decision boundary instead, tested in test_lrp4rag.py)
    probe_probs = det.score(probe)
    labels = [s.label for s in probe]
    if name != "lrp4rag":
        assert f1_score(labels, probe_probs >= det.threshold) == pytest.approx(
            max(f1_score(labels, probe_probs >= c) for c in np.unique(probe_probs)))
    else:  # the SVM's decision value 0, calibrated
        assert det.threshold == pytest.approx(float(det.calibrator.transform(np.array([0.0]))[0]))
    for sample in held_out[:2]:
        for span in det.spans(sample):
            assert sample.response[span["start"] : span["end"]] == span["text"] and span["text"].strip()
    path = tmp_path / f"{name}.json"
    det.save(path)
    again = load_detector(str(path), scorer=scorer)
    np.testing.assert_allclose(again.score(held_out), probs)
    assert again.spans(held_out[0]) == det.spans(held_out[0])


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
    assert default.name == "toha" and default.fitted_on["n"] > 2000  # RAGTruth QA train, all three generators
    assert len(default.heads) <= default.settings["n_max"]
    for name in shipped:
        det = load_detector(name)
        assert det.identity["scoring_model"] == "smollm2-135m" and "RAGTruth" in det.fitted_on["data"]
        assert det.fitted_on["n"] >= 100 and 0 < det.threshold < 1
