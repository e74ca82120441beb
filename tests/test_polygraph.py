"""LM-Polygraph's estimators as detectors (``polygraph:NAME``): the teacher-forced statistics against LM-Polygraph's
own generation path on the real default model, the detector contract, the spec, and the shared cache."""

import numpy as np
import pytest

from halwatch.detectors import create_detector, load_detector, split_spec
from halwatch.detectors import polygraph as pg
from halwatch.errors import HalwatchError, InputError
from halwatch.models import forward
from halwatch.models.signal_types import SignalRequest
from halwatch.sample import Sample
from halwatch.scorer import Scorer

#: A short RAG-style prompt whose greedy continuation by SmolLM2 is 8 tokens without an end-of-sequence token, and
#: whose end-of-sequence probability at the first two steps is below 1e-8 (LM-Polygraph's generation suppresses it
#: there, ``min_new_tokens=2``, which shifts its log-probabilities by that much).
PROMPT = ("Context: The Eiffel Tower is in Paris, the capital of France. It was built in 1889.\n"
          "Question: When was the Eiffel Tower built?\nAnswer: The Eiffel Tower")
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def reference(smol):
    """LM-Polygraph's own path: its WhiteboxModel around the model and tokenizer that halwatch loaded, greedy
    generation with GreedyProbsCalculator (attention maps on), then its entropy, forward-pass attention and CSL
    eliciting-prompt calculators, and every supported estimator on those statistics."""
    from lm_polygraph import WhiteboxModel, estimators
    from lm_polygraph.stat_calculators.attention_eliciting_prompt import AttentionElicitingPromptCalculator
    from lm_polygraph.stat_calculators.attention_forward_pass import AttentionForwardPassCalculator
    from lm_polygraph.stat_calculators.entropy import EntropyCalculator
    from lm_polygraph.stat_calculators.greedy_probs import GreedyProbsCalculator

    from halwatch.models import forward

    model = WhiteboxModel(smol.model, smol.tokenizer, model_path="smollm2-135m")
    smol.model.set_attn_implementation("eager")  # LM-Polygraph reads the attention maps that eager attention returns
    try:
        stats = GreedyProbsCalculator(output_attentions=True)({}, [PROMPT], model, max_new_tokens=NEW_TOKENS)
        for calc in (EntropyCalculator(), AttentionForwardPassCalculator(), AttentionElicitingPromptCalculator()):
            stats.update(calc(stats, [PROMPT], model))
    finally:
        forward.install(smol.model)
    stats["model"] = model
    scores = {name: float(getattr(estimators, name)()(stats)[0]) for name in pg.ESTIMATORS}
    return stats, scores


def test_teacher_forced_stats_match_lm_polygraph_generation(reference, smol):
    ref, ref_scores = reference
    tokens = ref["greedy_tokens"][0]
    assert len(tokens) == NEW_TOKENS and smol.tokenizer.eos_token_id not in tokens
    scorer = Scorer(model=smol, input_mode="raw", max_tokens=512, cache=None)
    view = scorer.encode(Sample(prompt=PROMPT, response=ref["greedy_texts"][0]))
    assert view.input_ids[: view.n_prompt] == ref["input_tokens"][0] and view.input_ids[view.n_prompt :] == tokens

    ours = pg.teacher_forced_stats(smol, view)
    assert ours["greedy_tokens"] == ref["greedy_tokens"] and ours["greedy_texts"] == ref["greedy_texts"]
    # the response tokens' log-likelihoods
    np.testing.assert_allclose(ours["greedy_log_likelihoods"][0], ref["greedy_log_likelihoods"][0], rtol=0, atol=1e-5)
    # whole distributions: LM-Polygraph's generation sets the end-of-sequence logit of the first two steps to the row
    # minimum (min_new_tokens=2); elsewhere the two paths (cached incremental decoding with eager attention, one
    # pass with SDPA) differ by float32 rounding only: relative 1e-5 (a few 1e-5 on log-probabilities near -25)
    theirs, mine = ref["greedy_log_probs"][0].copy(), ours["greedy_log_probs"][0].copy()
    assert mine.shape == theirs.shape == (NEW_TOKENS, len(smol.tokenizer))
    eos = smol.tokenizer.eos_token_id
    assert np.exp(mine[:2, eos]).max() < 1e-8
    theirs[:2, eos] = mine[:2, eos] = 0.0
    np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5)
    # attention: the response block of every head, the middle layer's whole map, CSL's eliciting-prompt weights
    assert ours["attention_all"][0].shape == ref["attention_all"][0].shape
    np.testing.assert_allclose(ours["attention_all"][0], ref["attention_all"][0], rtol=0, atol=1e-5)
    middle = ours["attention_score_layer"]
    np.testing.assert_allclose(ours["forwardpass_attention_weights"][0][0],
                               ref["forwardpass_attention_weights"][0][middle], rtol=0, atol=1e-5)
    weights = pg.eliciting_attention(smol, view, *pg._eliciting_prompt())
    np.testing.assert_allclose(weights, ref["attention_weights_eliciting_prompt"][0], rtol=0, atol=1e-5)

    scores = pg.polygraph_scores(ours)  # every estimator of the forward pass; adds LM-Polygraph's entropy
    np.testing.assert_allclose(ours["entropy"][0], ref["entropy"][0], rtol=0, atol=1e-5)
    scores |= pg.polygraph_scores({"greedy_log_likelihoods": ours["greedy_log_likelihoods"],
                                   "attention_weights_eliciting_prompt": [weights]}, ["CSL"])
    assert set(scores) == set(pg.ESTIMATORS)
    for name, value in ref_scores.items():
        assert scores[name] == pytest.approx(value, rel=1e-5, abs=1e-5), name


def _small_probe(probe, n=6):
    """The ``n`` + ``n`` shortest answers of the probe (scored with a 256-token cap, which cuts their contexts)."""
    by_length = sorted(probe, key=lambda s: len(s.response))
    return [s for s in by_length if s.label][:n] + [s for s in by_length if not s.label][:n]


def test_detector_fits_scores_and_one_cached_pass_feeds_every_estimator(spans_of, smol, probe, tmp_path, request):
    small = _small_probe(probe)
    scorer = Scorer(model=smol, input_mode="raw", max_tokens=256, cache=tmp_path, windows=1)  # one view per answer
    det = create_detector("polygraph:Perplexity", scorer=scorer).fit(small)
    assert det.settings["estimator"] == "Perplexity" and det.fitted_on["n"] == 12
    probs = det.score(small)
    assert probs.shape == (12,) and np.all((probs > 0) & (probs < 1))
    # LM-Polygraph's Perplexity on the teacher-forced pass is halwatch's perplexity baseline (its own forward pass)
    views = [scorer.encode(s) for s in small[:3]]
    baseline = [-float(np.mean(s.logprobs)) for s in forward.run(smol, views, SignalRequest(token_stats=True))]
    np.testing.assert_allclose(det.raw_scores(scorer.signals(small[:3], det.request())), baseline, rtol=0, atol=1e-5)
    # the cache entry holds every estimator of the pass, as LM-Polygraph computes them on the statistics
    cached = scorer.signals(small[:1], det.request())[0].extra
    direct = pg.polygraph_scores(pg.teacher_forced_stats(smol, views[0]))
    assert set(direct) < set(cached) and all(float(cached[k]) == pytest.approx(v, rel=1e-6) for k, v in direct.items())

    calls = []  # forward passes of the model from here on
    hook = smol.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    request.addfinalizer(hook.remove)
    again = Scorer(model=smol, input_mode="raw", max_tokens=256, cache=tmp_path, windows=1)  # a new scorer: the cache
    for name in (n for n, group in pg.ESTIMATORS.items() if group == "forward"):
        raw = create_detector(f"polygraph:{name}", scorer=again).fit(small).raw_scores(
            again.signals(small, create_detector(f"polygraph:{name}").request()))
        assert np.all(np.isfinite(raw)), name
    np.testing.assert_allclose(create_detector("polygraph:Perplexity", scorer=again).fit(small).score(small), probs)
    det.save(tmp_path / "polygraph.json")
    loaded = load_detector(str(tmp_path / "polygraph.json"), scorer=again)
    assert loaded.settings["estimator"] == "Perplexity" and spans_of(loaded, small[0]) == []  # no token scores
    np.testing.assert_allclose(loaded.score(small), probs)
    assert not calls  # every estimator, the rerun and the saved detector read the one cached pass per answer

    # CSL adds its own eliciting-prompt pass, reusing the cached forward pass; then it is cached too
    pair = [small[0], small[-1]]
    csl = create_detector("polygraph:CSL", scorer=again).fit(pair)
    assert len(calls) == 2 and np.all(np.isfinite(csl.raw_scores(again.signals(pair, csl.request()))))
    create_detector("polygraph:CSL", scorer=Scorer(model=smol, max_tokens=256, cache=tmp_path)).fit(pair)
    assert len(calls) == 2


def test_spec_positional_setting_and_errors(monkeypatch):
    assert split_spec("polygraph:Perplexity") == ("polygraph", {"estimator": "Perplexity"})
    assert split_spec("polygraph:RAUQ,calibration=isotonic") == ("polygraph",
                                                                 {"estimator": "RAUQ", "calibration": "isotonic"})
    assert split_spec("lrp4rag:classifier=mlp") == ("lrp4rag", {"classifier": "mlp"})
    assert create_detector("polygraph").settings["estimator"] == "MaximumSequenceProbability"
    assert create_detector("polygraph:MeanTokenEntropy").settings["estimator"] == "MeanTokenEntropy"
    with pytest.raises(HalwatchError, match=r"unknown LM-Polygraph estimator 'Nope': supported are "
                                            r"MaximumSequenceProbability, Perplexity, MeanTokenEntropy"):
        create_detector("polygraph:Nope")
    with pytest.raises(HalwatchError, match=r"'Focus' is not offered here \(needs an IDF table .*\): supported are"):
        create_detector("polygraph:Focus")
    with pytest.raises(InputError, match="takes its settings as KEY=VALUE"):
        split_spec("perplexity:Perplexity")
    with pytest.raises(InputError, match="two bare values"):
        split_spec("polygraph:RAUQ,CSL")
    with pytest.raises(InputError, match="sets 'estimator' twice"):
        split_spec("polygraph:RAUQ,estimator=CSL")
    with pytest.raises(HalwatchError, match="unknown detector 'nope'"):
        split_spec("nope:Perplexity")

    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(HalwatchError, match=r"pip install -e \.\[polygraph\]"):
        create_detector("polygraph:Perplexity").request()
