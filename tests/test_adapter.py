"""The adapter (issue 75) on the real default model: its layers, run after the pass on the pass's own states, equal
transformers' own forward continued from a key/value cache of the prompt (with the updates at zero and with random
updates merged into the weights); batched and one-by-one log-odds are equal; a tiny fit learns its answers' spans,
resumes an interrupted training to the same weights, and its artifact scores as the fitted detector does."""

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from halwatch.detectors import adapter_fit, create_detector, load_detector
from halwatch.detectors.adapter import load_adapter
from halwatch.errors import HalwatchError, InputError
from halwatch.eval.protocols import Bench
from halwatch.models import adapter as adapter_lib
from halwatch.models import forward
from halwatch.models.registry import home
from halwatch.models.signal_types import SignalRequest
from halwatch.scorer import Scorer


@pytest.fixture(scope="module")
def raw(smol):
    return Scorer(model=smol, input_mode="raw", max_tokens=512, cache=None)


def random_adapter(model, seed: int = 1):
    """A fresh adapter with random updates and head (nothing trained)."""
    adapter = adapter_lib.new_adapter(model, *adapter_lib.default_layers(30), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in adapter.b.values():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.02)
        adapter.head.weight.copy_(torch.randn(adapter.head.weight.shape, generator=gen) * 0.1)
    return adapter


def continued(model, adapter, ids, n_prompt):
    """Reference: transformers' own forward of the prompt (frozen) into its key/value cache, then of the response
    tokens from that cache through a copy of the model whose adapted layers hold ``W0 + scale B A``: the response's
    hidden state leaving the last adapted layer, through the final norm and the head."""
    frozen = model(input_ids=ids[:, :n_prompt], use_cache=True)
    changed = copy.deepcopy(model)
    layers = changed.get_decoder().layers
    with torch.no_grad():
        for j in range(adapter.depth):
            for name, weight in adapter.merged(model, j, torch.float32).items():
                layers[adapter.start + j].get_submodule(name.removesuffix(".weight")).weight.copy_(weight)
    out = changed(input_ids=ids[:, n_prompt:], past_key_values=frozen.past_key_values, output_hidden_states=True)
    x = out.hidden_states[adapter.start + adapter.depth][0].float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.get_decoder().norm.variance_epsilon) * adapter.norm
    return adapter.head(x)[:, 0].detach().numpy()


@pytest.mark.parametrize("updates", [False, True])
def test_adapter_equals_transformers_continued_from_the_prompt_cache(smol, raw, probe_by_size, updates):
    model = smol.model
    adapter = random_adapter(model) if updates else adapter_lib.new_adapter(model, 15, 6)
    if not updates:
        with torch.no_grad():
            adapter.head.weight.normal_(0, 0.1)
    request = adapter_lib.AdapterRequest.of(adapter.arrays(), 15, 6, adapter.rank, adapter.alpha)
    view = raw.encode(probe_by_size[0])
    mine = forward.run(smol, [view], SignalRequest(adapter=request))[0].adapter
    with torch.no_grad():
        theirs = continued(model, adapter, torch.tensor([view.input_ids]), view.n_prompt)
    assert mine.shape == (view.n_response,)
    assert np.abs(mine - theirs).max() < 1e-3 * max(1.0, np.abs(theirs).max())
    assert np.std(theirs) > 0.01  # the head reads something that varies along the answer


def test_batched_equals_one_by_one_and_other_signals_unchanged(smol, raw, probe_by_size):
    adapter = random_adapter(smol.model, seed=2)
    request = adapter_lib.AdapterRequest.of(adapter.arrays(), 15, 6, adapter.rank, adapter.alpha)
    views = [raw.encode(s) for s in probe_by_size[:3]]
    both = SignalRequest(adapter=request, token_stats=True)
    batched = forward.run(smol, views, both)
    plain = forward.run(smol, views, SignalRequest(token_stats=True))
    for view, sig, alone in zip(views, batched, plain):
        one = forward.run(smol, [view], SignalRequest(adapter=request))[0]
        assert np.abs(sig.adapter - one.adapter).max() < 1e-3
        np.testing.assert_allclose(sig.logprobs, alone.logprobs, atol=1e-5)
    assert both.key()["adapter"]["sha"] == request.sha
    assert "adapter" not in SignalRequest(token_stats=True).key()


@pytest.fixture(scope="module")
def tiny(smol, short_answers, tmp_path_factory):
    """An adapter fitted on the eight SQuAD-built training answers (swapped words are the spans), float32, and a
    scorer whose cache the tests of this module share (so that a stack fitted on these answers reads their passes)."""
    fit, _ = short_answers
    scorer = Scorer(model=smol, input_mode="raw", max_tokens=512, cache=tmp_path_factory.mktemp("signals"))
    detector = create_detector("adapter", scorer=scorer, epochs=4, lr=3e-3, accumulate=1, folds=2, seed=0)
    detector.fit(fit)
    return detector, scorer


def test_tiny_fit_learns_its_spans_and_its_artifact_scores_the_same(tiny, short_answers, tmp_path):
    detector, scorer = tiny
    fit, held = short_answers
    views = [scorer.encode(s) for s in fit]
    signals = scorer.signals(fit, detector.request(), views=views)
    labels = np.concatenate([v.token_labels() for v in views])
    assert labels.sum() > 0
    assert roc_auc_score(labels, np.concatenate(detector.token_scores(signals))) > 0.9  # learnt in sample
    assert detector.fitted_on["n"] == 8 and detector.fitted_on["work"].startswith("adapter-")
    path = tmp_path / "adapter.json"
    detector.save(path)
    loaded = load_detector(path, scorer=scorer)
    np.testing.assert_allclose(loaded.score(held), detector.score(held), atol=1e-6)
    with pytest.raises(HalwatchError, match="fit\\(samples\\)"):
        create_detector("adapter", scorer=scorer).fit_signals(signals, [s.label for s in fit], views)


def test_an_interrupted_training_resumes_to_the_same_weights(tiny, smol, short_answers, tmp_path, monkeypatch):
    fit, _ = short_answers
    scorer = tiny[1]
    views = [scorer.encode(s) for s in fit]
    records = adapter_fit.capture_inputs(smol, views, 15, 6, home() / "fits" / tiny[0].fitted_on["work"])
    settings = {"rank": 4, "alpha": 8.0, "epochs": 2, "lr": 2e-3, "accumulate": 2, "seed": 3, "start": 15, "depth": 6}
    whole = adapter_fit.train(smol, records, list(range(8)), settings, tmp_path / "whole.pt")
    monkeypatch.setattr(adapter_fit, "CHECKPOINT_EVERY", 4)

    class Interrupted(list):
        served = 0

        def __getitem__(self, i):
            Interrupted.served += 1
            # read once each to find the labelled ones, then eight in the first epoch: this is the second epoch's
            # sixth answer, after the checkpoint written at its fourth
            if Interrupted.served == 8 + 8 + 6:
                raise KeyboardInterrupt
            return super().__getitem__(i)

    with pytest.raises(KeyboardInterrupt):
        adapter_fit.train(smol, Interrupted(records), list(range(8)), settings, tmp_path / "cut.pt")
    assert (tmp_path / "cut.pt").exists() and not (tmp_path / "cut.npz").exists()
    resumed = adapter_fit.train(smol, records, list(range(8)), settings, tmp_path / "cut.pt")
    assert not (tmp_path / "cut.pt").exists()
    for name in whole:
        np.testing.assert_allclose(resumed[name], whole[name], atol=1e-6)
    assert any(np.abs(whole[k]).max() > 0 for k in whole if k.startswith("b."))  # it trained


def test_fit_needs_span_labels(raw, short_answers):
    fit, _ = short_answers
    without = [dataclasses.replace(s, spans=[]) for s in fit]
    with pytest.raises(InputError, match="span labels"):
        create_detector("adapter", scorer=raw).fit(without)


def test_an_adapter_setting_names_an_adapter(tmp_path):
    with pytest.raises(InputError, match="a routed artifact, not an adapter"):
        load_adapter("default")
    with pytest.raises(HalwatchError, match="no artifact file 'no-such-adapter'"):
        load_adapter("no-such-adapter")
    broken = tmp_path / "broken.json"
    broken.write_text("[1, 2", encoding="utf-8")
    with pytest.raises(HalwatchError, match="not a readable detector artifact"):
        load_adapter(str(broken))


def test_fused_stacks_the_adapter_out_of_fold(tiny, smol, short_answers, tmp_path):
    """The stack is fitted on each training answer's log-odds from the fold's adapter that did not see its source,
    which the pass with that fold's adapter gives; its artifact names the adapter and refuses another."""
    detector, scorer = tiny
    fit, held = short_answers
    path = tmp_path / "adapter.json"
    detector.save(path)
    # fixed regularisation and the linear token model: the family and its folds are under test, not the recipe
    fused = create_detector("fused", scorer=scorer, adapter=str(path), folds=2, C=1.0, token_C=0.001,
                            token_kind="linear")
    views = [scorer.encode(s) for s in fit]
    signals = scorer.signals(fit, fused.request(), views=views)
    plan = detector.fold_plan(views)
    assert sorted(i for idx in plan.values() for i in idx) == list(range(8))  # each was in one fold's held part
    swapped = fused._held_adapter(signals, views)
    for k, idx in plan.items():
        for i in idx:
            theirs = forward.run(smol, [views[i]], SignalRequest(adapter=detector.fold_request(k)))[0].adapter
            np.testing.assert_allclose(swapped[i].adapter, theirs, atol=1e-4)
            assert np.abs(swapped[i].adapter - signals[i].adapter).max() > 1e-3  # not the final adapter's
            np.testing.assert_array_equal(swapped[i].logprobs, signals[i].logprobs)
    other = [scorer.encode(s) for s in held]
    assert detector.fold_plan(other) == {}  # sources it never trained on keep the final adapter's
    routed = create_detector("routed", scorer=scorer, adapter=str(path))
    for stack in (fused, routed):
        assert stack.adapter_trained_on(views) == list(range(8)) and stack.adapter_trained_on(other) == []
    fused.fit(fit)
    assert "adapter" in fused.coefficients()
    bench = Bench(scorer, [], progress=False)  # a bench never scores the adapter's own training answers
    with pytest.raises(InputError, match="8 of the 8 answers to score share a source with the answers the "):
        bench.score_answers(fused, views, signals)
    assert len(bench.score_answers(fused, other, scorer.signals(held, fused.request(), views=other))[0][0]) == len(held)
    # a routed part that adapter_tasks does not name is fitted without the adapter, the pass still runs it
    apart = create_detector("routed", scorer=scorer, adapter=str(path), adapter_tasks="dialogue", folds=2, C=1.0,
                            token_C=0.001, token_kind="linear").fit(fit)
    assert "adapter" not in apart.for_task("qa").coefficients() and apart.request().adapter is not None
    for wrong in ({"adapter_tasks": "qa"}, {"adapter": str(path), "adapter_tasks": "qa+poems"}):
        with pytest.raises(ValueError, match="adapter_tasks: tasks"):
            create_detector("routed", **wrong)
    saved = tmp_path / "fused.json"
    fused.save(saved)
    np.testing.assert_allclose(load_detector(saved, scorer=scorer).score(held), fused.score(held), atol=1e-6)
    data = json.loads(saved.read_text())
    data["state"]["adapter_sha"] = "0" * 64
    with pytest.raises(HalwatchError, match="not the one this detector was fitted with"):
        load_detector(data, scorer=scorer).score(held)


def test_the_pass_with_an_adapter_serves_the_white_box_pass(smol, probe_by_size, tmp_path):
    scorer = Scorer(model=smol, input_mode="raw", max_tokens=512, cache=tmp_path / "signals")
    adapter = random_adapter(smol.model, seed=3)
    request = adapter_lib.AdapterRequest.of(adapter.arrays(), 15, 6, adapter.rank, adapter.alpha)
    whitebox = forward.whitebox_request(smol)
    sample = probe_by_size[0]
    assert scorer.cached([scorer.encode(sample)], whitebox) == [False]
    wide = scorer.signals([sample], whitebox.merge(SignalRequest(adapter=request)))[0]
    assert scorer.cached([scorer.encode(sample)], whitebox) == [True]  # no second pass for the plain request
    served = scorer.signals([sample], whitebox)[0]
    fresh = Scorer(model=smol, input_mode="raw", max_tokens=512, cache=None).signals([sample], whitebox)[0]
    np.testing.assert_allclose(served.logprobs, fresh.logprobs, atol=1e-5)
    np.testing.assert_array_equal(served.adapter, wide.adapter)
