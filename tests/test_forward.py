import numpy as np
import pytest
import torch

from halwatch import Sample
from halwatch.models import capture, forward
from halwatch.models.signal_types import SignalRequest
from halwatch.scorer import Scorer
from halwatch.signals.topology import mtopdiv


def _eager(smol, view):
    """Reference: transformers' own eager attention with every map materialised."""
    smol.model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            return smol.model(torch.tensor([view.input_ids]), output_attentions=True, output_hidden_states=True)
    finally:
        forward.install(smol.model)


@pytest.mark.parametrize("mode", ["raw", "chat"])
def test_signals_match_eager_reference(smol, probe, mode):
    scorer = Scorer(model=smol, input_mode=mode, max_tokens=400, cache=None)
    sample = probe[0]
    view = scorer.encode(sample)
    heads = ((0, 0), (5, 3), (21, 6), (29, 8))
    req = SignalRequest(token_stats=True, hidden_layers=(0, 15, 30), heads=heads, keep_attention=True)
    sig = scorer.signals([sample], req)[0]
    ref = _eager(smol, view)
    p = view.n_prompt
    for i, (layer, head) in enumerate(heads):
        np.testing.assert_allclose(sig.attention[i], ref.attentions[layer][0, head, p:].numpy(), atol=2e-5)
    assert view.n_response > 2 * forward.logit_rows(ref.logits)  # normalised in several pieces (on a CPU)
    logp = torch.log_softmax(ref.logits[0, p - 1 : -1].float(), -1)
    target = torch.tensor(view.input_ids[p:])
    np.testing.assert_allclose(sig.logprobs, logp.gather(1, target[:, None])[:, 0].numpy(), atol=1e-4)
    np.testing.assert_allclose(sig.entropy, (-(logp.exp() * logp).sum(-1)).numpy(), atol=1e-4)
    for j, layer in enumerate((0, 15, 30)):
        np.testing.assert_allclose(sig.hidden[j], ref.hidden_states[layer][0, p:].numpy(), atol=1e-3)
    assert sig.logprobs.shape == sig.entropy.shape == (view.n_response,)


def test_attention_rows_of_all_tokens(smol, probe):
    scorer = Scorer(model=smol, max_tokens=350, cache=None)
    view = scorer.encode(probe[1])
    sig = scorer.signals([probe[1]], SignalRequest(heads=((3, 1),), attention_from="all", keep_attention=True))[0]
    ref = _eager(smol, view)
    np.testing.assert_allclose(sig.attention[0], ref.attentions[3][0, 1].numpy(), atol=2e-5)


@pytest.mark.parametrize("mode", ["raw", "chat"])
def test_reducers_equal_the_numpy_references_on_eager_maps(smol, probe, mode):
    """The torch reducers of the pass (lookback, MTop-Div, diagonal, sink) against the NumPy references, written
    from the formulas, on transformers' eager attention maps of the same input: equal within 1e-5."""
    from halwatch.signals.lookback import copy_mass, lookback_ratios

    scorer = Scorer(model=smol, input_mode=mode, max_tokens=300, cache=None)
    view = scorer.encode(probe[2])
    assert view.n_header > 0  # RAGTruth's "\noutput:" line, or the chat template's assistant header
    heads = ((0, 3), (17, 2), (21, 6), (29, 8))
    sig = scorer.signals([probe[2]], SignalRequest(heads=heads, reducers=("copy", "diag", "lookback", "mtopdiv",
                                                                          "sink")))[0]
    maps = _eager(smol, view).attentions
    p, n = view.n_prompt, len(view.input_ids)
    full = np.stack([maps[layer][0, head].numpy() for layer, head in heads]).astype(np.float64)  # [H, n, n]
    r = np.arange(n - p)
    np.testing.assert_allclose(sig.reduced["lookback.ratio"], lookback_ratios(full[:, p - 1 : n - 1], p,
                                                                               view.n_header), atol=1e-5)
    np.testing.assert_allclose(sig.reduced["mtopdiv.d"], mtopdiv(full[:, p:], p).d, atol=1e-5)
    np.testing.assert_allclose(sig.reduced["mtopdiv.token_weights"], mtopdiv(full[:, p:], p).token_weights,
                               atol=1e-5)
    np.testing.assert_allclose(sig.reduced["diag.w"], full[:, p + r, p + r], atol=1e-5)
    np.testing.assert_allclose(sig.reduced["sink.w"], full[:, p:, 0], atol=1e-5)
    copied = copy_mass(full[:, p - 1 : n - 1], view.input_ids, p, view.n_header)
    np.testing.assert_allclose(sig.reduced["copy.mass"], copied, atol=1e-5)
    assert copied.max() > 0.1 and (copied == 0).any()  # heads that copy, and tokens that occur nowhere before


def test_mst_reducer_equals_the_numpy_reference(smol, probe):
    from halwatch.signals.topology import mst_length

    scorer = Scorer(model=smol, max_tokens=200, cache=None)
    heads = ((3, 1), (21, 6))
    req = SignalRequest(heads=heads, reducers=("mst",), attention_from="all", keep_attention=True)
    sig = scorer.signals([min(probe, key=lambda s: len(s.response))], req)[0]
    np.testing.assert_allclose(sig.reduced["mst.d"], mst_length(sig.attention, sig.n_prompt).d, atol=1e-5)
    with pytest.raises(ValueError, match="needs the attention rows of every token"):
        SignalRequest(heads=heads, reducers=("mst",))


def test_batched_equals_one_at_a_time(smol, probe):
    samples = probe[:3] + probe[-3:]
    heads = ((2, 4), (19, 0), (21, 6))
    req = SignalRequest(token_stats=True, hidden_layers=(30,), heads=heads, reducers=("mtopdiv",))
    single = Scorer(model=smol, max_tokens=400, cache=None, batch_size=1).signals(samples, req)
    batched = Scorer(model=smol, max_tokens=400, cache=None, batch_size=4).signals(samples, req)
    for a, b in zip(single, batched):
        assert (a.n_prompt, a.n_response) == (b.n_prompt, b.n_response)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
        np.testing.assert_allclose(a.entropy, b.entropy, atol=1e-4)
        np.testing.assert_allclose(a.hidden, b.hidden, atol=1e-3)
        np.testing.assert_allclose(a.reduced["mtopdiv.d"], b.reduced["mtopdiv.d"], atol=1e-5)


@pytest.mark.parametrize("group", [None, 1])
def test_every_signal_of_a_padded_batch_equals_the_references(smol, probe, group, monkeypatch):
    """One batch of four answers of different prompt and response lengths, every signal of the white-box pass
    computed for all of them at once (as on a GPU; and one at a time, as on a CPU), against each answer's own eager
    attention maps and hidden states (unpadded, one at a time) and the NumPy references written from the papers'
    formulas."""
    from halwatch.signals.lookback import copy_mass, lookback_ratios
    from halwatch.signals.topology import mst_length

    monkeypatch.setattr(capture, "CPU_GROUP", group)

    scorer = Scorer(model=smol, max_tokens=300, cache=None, batch_size=4)
    samples = [probe[0], probe[2], probe[-1], min(probe, key=lambda s: len(s.response))]
    views = [scorer.encode(s) for s in samples]
    assert len({v.n_prompt for v in views}) > 1 and len({v.n_response for v in views}) > 1
    heads = ((0, 3), (17, 2), (29, 8))
    req = SignalRequest(token_stats=True, hidden_layers=(15, 30), hidden_pool="mean_last", token_hidden_layers=(15,),
                        heads=heads, reducers=("copy", "diag", "lookback", "mtopdiv", "sink"))
    every_row = SignalRequest(heads=heads, reducers=("mst",), attention_from="all", keep_attention=True)
    signals = scorer.signals(samples, req, views=views)
    rows = scorer.signals(samples, every_row, views=views)
    for view, sig, all_rows in zip(views, signals, rows):
        ref = _eager(smol, view)
        p, n = view.n_prompt, len(view.input_ids)
        full = np.stack([ref.attentions[layer][0, head].numpy() for layer, head in heads]).astype(np.float64)
        r = np.arange(n - p)
        np.testing.assert_allclose(sig.reduced["lookback.ratio"], lookback_ratios(full[:, p - 1 : n - 1], p,
                                                                                   view.n_header), atol=1e-5)
        topo = mtopdiv(full[:, p:], p)
        np.testing.assert_allclose(sig.reduced["mtopdiv.d"], topo.d, atol=1e-5)
        np.testing.assert_allclose(sig.reduced["mtopdiv.token_weights"], topo.token_weights, atol=1e-5)
        np.testing.assert_allclose(sig.reduced["diag.w"], full[:, p + r, p + r], atol=1e-5)
        np.testing.assert_allclose(sig.reduced["sink.w"], full[:, p:, 0], atol=1e-5)
        np.testing.assert_allclose(sig.reduced["copy.mass"], copy_mass(full[:, p - 1 : n - 1], view.input_ids, p,
                                                                        view.n_header), atol=1e-5)
        np.testing.assert_allclose(all_rows.attention, full, atol=2e-5)
        np.testing.assert_allclose(all_rows.reduced["mst.d"], mst_length(full, p).d, atol=1e-5)
        logp = torch.log_softmax(ref.logits[0, p - 1 : -1].float(), -1)
        np.testing.assert_allclose(sig.logprobs, logp.gather(1, torch.tensor(view.input_ids[p:])[:, None])[:, 0],
                                   atol=1e-4)
        np.testing.assert_allclose(sig.entropy, (-(logp.exp() * logp).sum(-1)).numpy(), atol=1e-4)
        for j, layer in enumerate((15, 30)):
            states = ref.hidden_states[layer][0, p:].numpy()
            np.testing.assert_allclose(sig.hidden[j], np.stack([states.mean(0), states[-1]]), atol=1e-3)
        np.testing.assert_allclose(sig.token_hidden[0], ref.hidden_states[15][0, p:].numpy(), rtol=2e-3, atol=2e-2)


def test_bad_requests_are_refused(smol):
    scorer = Scorer(model=smol, cache=None)
    with pytest.raises(ValueError, match="30 layers x 9 heads"):
        scorer.signals([Sample(prompt="p", response="r")], SignalRequest(heads=((30, 0),)))
    with pytest.raises(ValueError, match="unknown attention reducer"):
        SignalRequest(heads=((0, 0),), reducers=("nope",))


def test_requests_merge():
    a = SignalRequest(token_stats=True)
    b = SignalRequest(heads=((1, 2),), reducers=("mtopdiv",))
    merged = a.merge(b)
    assert merged.token_stats and merged.heads == ((1, 2),) and merged.covers(a) and merged.covers(b)
    assert not a.covers(b)


def test_pooled_hidden_states_and_diag_reducer(smol, probe):
    scorer = Scorer(model=smol, max_tokens=400, cache=None)
    heads = ((4, 2), (20, 5))
    full = scorer.signals(probe[:1], SignalRequest(hidden_layers=(15,), heads=heads, keep_attention=True,
                                                   reducers=("diag",)))[0]
    pooled = scorer.signals(probe[:1], SignalRequest(hidden_layers=(15,), hidden_pool="mean_last"))[0]
    np.testing.assert_allclose(pooled.hidden[0, 0], full.hidden[0].mean(0), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(pooled.hidden[0, 1], full.hidden[0, -1], rtol=1e-5, atol=1e-4)
    r = np.arange(full.n_response)
    np.testing.assert_allclose(full.reduced["diag.w"], full.attention[:, r, full.n_prompt + r])


def test_the_speed_split_times_every_forward_of_the_scoring_path(smol, tmp_path):
    """`halwatch bench speed --parts split`: the forward clock counts the time of each forward pass of the scoring
    path (one per batch), and the split adds up: inside + outside = the whole path."""
    from halwatch.eval.speed import ForwardClock, batched_rate, default_pipeline, forward_split

    pipeline = default_pipeline(smol)
    answers = [Sample(prompt="Q: Which city is the capital of France?\nAnswer:", response=r, id=str(i))
               for i, r in enumerate(("Paris.", "It is Lyon, I think.", "Paris, on the Seine."))]
    forward.install(smol.model)  # the capture's check runs two passes once per model, on its first use: not below
    calls = []
    clock = ForwardClock(smol.model)
    counter = smol.model.register_forward_hook(lambda *a: calls.append(1))
    try:
        pipeline.score(pipeline.encode(answers), batch_size=1)
    finally:
        clock.close()
        counter.remove()
    assert len(calls) == 3 and clock.seconds > 0
    lines = []
    rows = forward_split(pipeline, batches=(1, 3), out=lines.append, samples=answers)
    assert [r["batch"] for r in rows] == [1, 3] and lines[-1].startswith("| 3 |")
    for r in rows:
        assert r["answers"] == 3 and r["inside_s"] > 0 and r["outside_s"] > 0 and r["plain_forward_s"] > 0
        assert r["inside_s"] + r["outside_s"] == pytest.approx(r["total_s"])
    # --parts batched: the whole path in the scorer's own batches against a plain forward of the same batches
    lines = []
    row = batched_rate(pipeline, repeats=1, out=lines.append, samples=answers)
    passes = 3 if smol.device.type == "cpu" else 1  # --batch-size auto: one answer per pass on a CPU
    assert row["answers"] == 3 and row["batches"] == passes and row["answers_per_s"] > 0
    assert row["ratio"] == pytest.approx(row["answers_per_s"] / row["plain_forward_answers_per_s"])
    assert "answers/s" in lines[-1] and f"in {passes} batches" in lines[-1]
    # --processes 2: two processes of their own, each with its model, score the answers together (a core each)
    row = batched_rate(pipeline, repeats=1, out=lines.append, processes=2, samples=answers)
    assert row["processes"] == 2 and row["answers"] == 3 and row["answers_per_s"] > 0
    assert "2 processes together" in lines[-1]
    # a process that cannot load its model stops the measure with its reason, at once
    from types import SimpleNamespace

    from halwatch.eval.speed import _rate_of_processes

    nowhere = SimpleNamespace(name="nowhere", path=str(tmp_path / "no-model"), device="cpu", dtype="float32")
    with pytest.raises(RuntimeError, match="a scoring process failed: ModelError"):
        _rate_of_processes(nowhere, 2, answers, 1)
    # --parts phases: each phase timed, the inner ones within the outer ones, and nothing timed once it is done
    from halwatch.eval.speed import phases
    from halwatch.timing import active

    lines = []
    spent = phases(pipeline, batch_size=3, out=lines.append, samples=answers)["ms_per_answer"]
    assert active() is None
    assert all(v > 0 for v in spent.values())
    assert spent["token statistics, hidden states"] < spent["forward pass with the capture"]
    assert spent["token features"] + spent["token model"] < spent["detector: scores and spans"]
    assert lines[-1].startswith("| - answer features |") and "answers/s with the timers on" in lines[0]
