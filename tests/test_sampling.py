"""Sampling baselines: answers sampled from the real default model, the yes/no judge, and each method's formula
on hand-made samples where the right answer is known."""

import numpy as np
import pytest

from halwatch.detectors import create_detector
from halwatch.errors import HalwatchError
from halwatch.models.sampling import SamplingRequest, draw_tokens, sample_answers, stop_ids, yes_probability
from halwatch.models.signal_types import SignalRequest, Signals
from halwatch.scorer import Scorer


def test_sampled_answers_are_seeded_and_well_formed(scorer, probe):
    view = scorer.encode(probe[0])
    req = SamplingRequest(n=3, max_new_tokens=12, seed=1)
    a = sample_answers(scorer.model, view, req, "raw")
    b = sample_answers(scorer.model, view, req, "raw")
    assert list(a["texts"]) == list(b["texts"]) and np.allclose(a["logprob"], b["logprob"])
    assert all(t.strip() and "\n" not in t for t in a["texts"])  # raw mode: one non-empty line each
    assert ((1 <= a["length"]) & (a["length"] <= 12)).all()
    assert (a["logprob"] < 0).all() and np.isfinite(a["logprob"]).all()
    assert a["embedding"].shape == (3, scorer.model.model.config.hidden_size)
    assert str(a["response"]).strip() == probe[0].response.strip()
    other = sample_answers(scorer.model, view, SamplingRequest(n=3, max_new_tokens=12, seed=2), "raw")
    assert list(other["texts"]) != list(a["texts"])


def test_judge_batches_match_single_questions(smol):
    prompts = ["Is water wet? Answer Yes or No.\nAnswer:",
               "Context: The meeting is on Monday at noon in room 4.\n\nSentence: The meeting is on Monday.\n\n"
               "Is the sentence supported by the context above? Answer Yes or No.\n\nAnswer:",
               "Premise: A cat.\n\nHypothesis: A dog.\n\nDoes the premise entail the hypothesis? Answer Yes or No."]
    batched = yes_probability(smol, prompts, "raw", batch_size=3)  # left-padded batch
    single = np.array([yes_probability(smol, [p], "raw")[0] for p in prompts])
    assert np.allclose(batched, single, atol=1e-4)
    assert ((0 < batched) & (batched < 1)).all()


def _newline_first(smol, n):
    """A raw prompt's key/value cache for ``n`` rows and its real next-token logits, with the line break raised
    40 above the best logit (it holds all but ~1e-17 of the mass: a nucleus of the line break alone)."""
    import torch

    ids = smol.tokenizer("Question: What is the capital of France?\nAnswer:", add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        out = smol.model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    cache.batch_repeat_interleave(n)
    real = out.logits[0, -1].float()
    newline = smol.tokenizer("\n", add_special_tokens=False)["input_ids"][0]
    crafted = real.clone()
    crafted[newline] = real.max() + 40
    return cache, real, crafted.repeat(n, 1), newline


def test_stop_tokens_are_masked_before_the_nucleus(smol):
    """A line break that holds ~all the mass before an answer has begun: the nucleus is taken over the other
    tokens (before the fix the row was all zeros: multinomial raised, greedy took id 0)."""
    import torch

    tok, model = smol.tokenizer, smol.model
    _, stop = stop_ids(tok, "raw")
    allowed = np.array([i not in stop for i in range(len(tok))])  # the logits may have more rows than the vocab
    n = 16
    cache, real, crafted, newline = _newline_first(smol, n)
    assert newline in stop
    # by hand: the distribution over the allowed tokens (the crafted logits equal the real ones there) and its
    # 0.5-nucleus (most likely first, while the mass before a token is <= 0.5)
    p = np.exp(real.numpy()[: len(tok)] - real.numpy()[: len(tok)][allowed].max()) * allowed
    p /= p.sum()
    order = np.argsort(-p)
    nucleus = set(order[(np.cumsum(p[order]) - p[order]) <= 0.5].tolist())
    with torch.inference_mode():
        drawn = draw_tokens(model, tok, cache, crafted, 1, "raw", torch.Generator().manual_seed(0), 1.0, 0.5)
    first = [t[0] for t in drawn["tokens"]]
    assert not drawn["done"].any() and all(t != 0 and t not in stop for t in first)
    assert set(first) <= nucleus
    logp = torch.log_softmax(crafted[0], -1).numpy()  # the model's log-probability (of the crafted logits)
    assert drawn["logprob"] == pytest.approx(logp[first], abs=1e-4)

    cache, real, crafted, _ = _newline_first(smol, 2)
    with torch.inference_mode():
        greedy = draw_tokens(model, tok, cache, crafted, 1, "raw", None, 1.0, 0.9, started=[False, True],
                             greedy=True)
    best = int(np.flatnonzero(allowed)[np.argmax(real.numpy()[: len(tok)][allowed])])
    assert greedy["tokens"][0] == [best] and best != 0 and not greedy["done"][0]  # not started: the best allowed
    assert greedy["tokens"][1] == [newline] and greedy["done"][1]  # started: the line break ends the answer


def _gen(texts, logprob, length, embedding=None, response="The answer."):
    k = len(texts)
    emb = np.random.default_rng(0).normal(size=(k, 8)) if embedding is None else embedding
    return Signals(n_prompt=5, n_response=3, generations={
        "texts": np.array(texts), "logprob": np.array(logprob, dtype=float), "length": np.array(length),
        "embedding": np.asarray(emb, dtype=float), "response": np.array(response)})


def test_ln_entropy_and_eigenscore_formulas():
    sig = _gen(["a", "b"], [-2.0, -9.0], [2, 3])
    assert create_detector("ln-entropy").raw_scores([sig])[0] == pytest.approx((1.0 + 3.0) / 2)
    same = _gen(["a"] * 4, [-1] * 4, [1] * 4, embedding=np.tile(np.arange(8.0), (4, 1)))
    diverse = _gen(list("abcd"), [-1] * 4, [1] * 4, embedding=np.random.default_rng(3).normal(size=(4, 8)) * 5)
    eig = create_detector("eigenscore", alpha=1e-3)
    low, high = eig.raw_scores([same, diverse])
    # identical samples: one eigenvalue K * |centred z|^2 = 4 * 42, the others alpha
    assert low == pytest.approx((np.log(4 * 42 + 1e-3) + 3 * np.log(1e-3)) / 4)
    assert high > low + 5


def test_selfcheck_ngram_prefers_words_the_samples_repeat():
    samples = ["Paris is the capital of France."] * 4
    consistent = _gen(samples, [-1] * 4, [5] * 4, response="Paris is the capital of France.")
    novel = _gen(samples, [-1] * 4, [5] * 4, response="Lyon was founded by Romans in 43 BC.")
    grounded, made_up = create_detector("selfcheck-ngram").raw_scores([consistent, novel])
    assert made_up > grounded


def test_semantic_entropy_of_identical_and_of_distinct_answers(scorer):
    det = create_detector("semantic-entropy", scorer=scorer, entail_threshold=1.01)  # judge never says "entails"
    same = _gen(["Paris."] * 3, [-1, -1, -1], [1, 1, 1])
    distinct = _gen(["Paris.", "Lyon.", "Nice."], [-1, -1, -1], [1, 1, 1])
    zero, spread = det.raw_scores([same, distinct])
    assert zero == pytest.approx(0.0) and spread == pytest.approx(np.log(3))


def test_sampling_request_is_cached_and_keys_of_other_requests_are_unchanged(smol, probe, tmp_path):
    assert "sampling" not in SignalRequest(token_stats=True).key()  # cache entries made before sampling stay valid
    scorer = Scorer(model=smol, max_tokens=512, cache=tmp_path)
    det = create_detector("ln-entropy", scorer=scorer, n_samples=2, max_new_tokens=6)
    first = scorer.signals(probe[:2], det.request())
    assert len(list(tmp_path.rglob("*.npz"))) == 2
    again = scorer.signals(probe[:2], det.request())
    assert [list(s.generations["texts"]) for s in first] == [list(s.generations["texts"]) for s in again]
    with pytest.raises(ValueError, match="different sampling settings"):
        det.request().merge(create_detector("eigenscore", n_samples=3).request())


def test_unknown_settings_are_refused():
    with pytest.raises(HalwatchError, match="no setting"):
        create_detector("eigenscore", n_sample=3)
    with pytest.raises(ValueError, match="n >= 1"):
        SamplingRequest(n=0)
