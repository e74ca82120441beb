"""Any causal LM: tiny random-weight models of nine architectures, built from their configs (nothing is downloaded)
with the default model's tokenizer. For each, the captured attention rows equal transformers' own eager attention
maps, the torch reducers of the pass equal the NumPy references written from the formulas, and every detector fits
and scores. An architecture whose attention cannot be captured is refused with its name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from halwatch.detectors import DETECTORS, create_detector
from halwatch.errors import ModelError
from halwatch.models import capture, forward
from halwatch.models.forward import whitebox_request
from halwatch.models.loader import ScoringModel
from halwatch.models.signal_types import SignalRequest
from halwatch.scorer import Scorer

WINDOW = 24  # sliding-window architectures get a window shorter than the inputs, so that it matters
ARCHITECTURES = {
    "llama": {},
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "qwen3": {},
    "gemma3_text": {"sliding_window": WINDOW, "head_dim": 16, "query_pre_attn_scalar": 16},
    # soft-capped attention logits: a cap of 1 bends every score of these random weights, so that it matters
    "gemma2": {"sliding_window": WINDOW, "head_dim": 16, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 1.0},
    "phi3": {},
    "olmo2": {},
    "gpt_neox": {"rotary_pct": 0.5},
}
#: what an architecture refuses, in one line naming why: relevance through Gemma 2's soft-capped logits, the adapter
REFUSED = {"gemma2": {"lrp4rag": "soft-capped attention logits"},
           # GPT-NeoX's layers take no key/value cache the adapter can hand them: its check refuses the architecture
           "gpt_neox": {"adapter": "cannot run the adapter on this architecture"}}
LAYERS, HEADS = 3, 4  # three layers: LM-Polygraph 0.7.0's RAUQ reads a layer past the end of a 2-layer model


def tiny_model(arch: str, tokenizer) -> ScoringModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                  num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=2048,
                                  vocab_size=len(tokenizer), **ARCHITECTURES[arch])
    model = AutoModelForCausalLM.from_config(config).eval()
    return ScoringModel(name=f"tiny-{arch}", path="", weights_hash=f"random-{arch}", model=model, tokenizer=tokenizer)


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def tiny(request, smol):
    return tiny_model(request.param, smol.tokenizer)


def _eager_maps(sm: ScoringModel, view) -> list[np.ndarray]:
    before = sm.model.config._attn_implementation
    sm.model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = sm.model(torch.tensor([view.input_ids]), output_attentions=True)
    finally:
        sm.model.set_attn_implementation(before)
    return [a[0].double().numpy() for a in out.attentions]


def test_capture_and_reducers_equal_the_references(tiny, probe):
    from halwatch.signals.lookback import lookback_ratios
    from halwatch.signals.topology import mtopdiv

    scorer = Scorer(model=tiny, max_tokens=300, cache=None)
    sample = probe[2]
    view = scorer.encode(sample)
    heads = tiny.all_heads()
    assert len(heads) == LAYERS * HEADS
    maps = _eager_maps(tiny, view)
    full = np.stack([maps[layer][head] for layer, head in heads])  # [H, n, n]
    p, n = view.n_prompt, len(view.input_ids)
    if ARCHITECTURES[tiny.name.removeprefix("tiny-")].get("sliding_window"):
        assert np.all(full[-HEADS:, -1, : n - WINDOW - 1] == 0)  # the last layer's window is in force here
    rows = scorer.signals([sample], SignalRequest(heads=heads, attention_from="all", keep_attention=True))[0]
    np.testing.assert_allclose(rows.attention, full, atol=2e-5)
    sig = scorer.signals([sample], SignalRequest(heads=heads, reducers=("diag", "lookback", "mtopdiv", "sink")))[0]
    r = np.arange(n - p)
    np.testing.assert_allclose(sig.reduced["lookback.ratio"], lookback_ratios(full[:, p - 1 : n - 1], p,
                                                                               view.n_header), atol=1e-5)
    np.testing.assert_allclose(sig.reduced["mtopdiv.d"], mtopdiv(full[:, p:], p).d, atol=1e-5)
    np.testing.assert_allclose(sig.reduced["diag.w"], full[:, p + r, p + r], atol=1e-5)
    np.testing.assert_allclose(sig.reduced["sink.w"], full[:, p:, 0], atol=1e-5)


#: the architectures every detector is fitted on (the others of ARCHITECTURES differ from these in their attention,
#: which the other tests here check, and every causal LM fits and scores Lookback Lens in the test after this one);
#: not llama: it is the default model's own, on which tests/test_detectors.py fits every detector
EVERY_DETECTOR_ON = ("gemma2", "gpt_neox", "qwen2")


@pytest.mark.parametrize("arch", EVERY_DETECTOR_ON)
def test_every_detector_fits_and_scores(spans_of, arch, smol, probe_by_size, tmp_path):
    """Every detector of halwatch fits on the 5 + 5 shortest probe answers scored by this architecture and scores
    held-out ones (the sampling baselines with two short samples each)."""
    tiny = tiny_model(arch, smol.tokenizer)
    by_length = probe_by_size
    train = [s for s in by_length if s.label][:5] + [s for s in by_length if not s.label][:5]
    held_out = [s for s in by_length if s not in train][:3]
    # one shared pass, as the benchmarks do (one view per answer: windows are tested on the default model)
    scorer = Scorer(model=tiny, max_tokens=400, cache=tmp_path, batch_size=None, windows=1)
    scorer.signals(train + held_out, whitebox_request(tiny))
    small = {"n_samples": 2, "max_new_tokens": 6}
    failed = {}
    refused = REFUSED.get(tiny.name.removeprefix("tiny-"), {})
    for name in sorted(DETECTORS):
        det = create_detector(name, scorer=scorer, **{k: v for k, v in small.items()
                                                      if k in DETECTORS[name].setting_names()})
        if name in refused:
            with pytest.raises(ModelError, match=refused[name]):
                det.fit(train)
            continue
        try:
            det.fit(train)
            probs = det.score(held_out)
            spans = spans_of(det, held_out[0])
        except Exception as exc:  # noqa: BLE001 - every detector's failure is reported, not only the first
            failed[name] = f"{type(exc).__name__}: {exc}"
            continue
        assert probs.shape == (3,) and np.all((probs > 0) & (probs < 1)), name
        assert all(held_out[0].response[s["start"] : s["end"]] == s["text"] for s in spans), name
        assert det.identity["scoring_model"] == tiny.name
    assert not failed, failed


def test_an_architecture_without_capturable_attention_is_refused_by_name(smol, probe):
    """Bloom runs its attention (with ALiBi) itself, not through transformers' attention interface: detectors that
    read attention are refused with the architecture named; token statistics still work on it."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    model = BloomForCausalLM(BloomConfig(vocab_size=len(smol.tokenizer), hidden_size=64, n_layer=2, n_head=4)).eval()
    bloom = ScoringModel(name="tiny-bloom", path="", weights_hash="random-bloom", model=model,
                         tokenizer=smol.tokenizer)
    scorer = Scorer(model=bloom, max_tokens=300, cache=None)
    with pytest.raises(ModelError, match=r"BloomForCausalLM \(model_type 'bloom'\): halwatch cannot capture"):
        scorer.signals(probe[:1], SignalRequest(heads=((0, 1),), reducers=("lookback",)))
    stats = scorer.signals(probe[:1], SignalRequest(token_stats=True))[0]
    assert stats.logprobs.shape == (stats.n_response,) and np.all(np.isfinite(stats.logprobs))
    assert forward.architecture(model) == "BloomForCausalLM (model_type 'bloom')"


def test_batched_signals_equal_one_at_a_time(tiny, probe_by_size, monkeypatch):
    """Right-padded batches give every signal of one-by-one passes, relevance included (in a sliding-window model
    a padding query may see no key at all: that must not leak NaN into the real rows). The capture computes the
    batch at once, as on a GPU."""
    from halwatch.models.relevance import RelevanceRequest

    monkeypatch.setattr(capture, "CPU_GROUP", None)

    samples = probe_by_size[:3]
    relevance = "lrp4rag" not in REFUSED.get(tiny.name.removeprefix("tiny-"), {})
    request = SignalRequest(token_stats=True, heads=((1, 0), (LAYERS - 1, 3)), reducers=("lookback", "mtopdiv"),
                            relevance=RelevanceRequest(method="lrp", target="max") if relevance else None)
    single = Scorer(model=tiny, max_tokens=400, cache=None, batch_size=1).signals(samples, request)
    batched = Scorer(model=tiny, max_tokens=400, cache=None, batch_size=3).signals(samples, request)
    for a, b in zip(single, batched):
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-4)
        for name in ("lookback.ratio", "mtopdiv.d"):
            np.testing.assert_allclose(b.reduced[name], a.reduced[name], atol=1e-4)
        for name in ("mean", "response") if relevance else ():
            assert np.all(np.isfinite(b.relevance[name]))
            np.testing.assert_allclose(b.relevance[name], a.relevance[name], atol=1e-4, rtol=1e-3)


def test_every_causal_lm_of_transformers_works_or_is_refused_by_name(smol, probe_by_size):
    """Every causal-LM architecture of the installed transformers, as a tiny random model built from its own config
    (:mod:`halwatch.eval.architectures`): either its captured attention rows of a probe answer equal transformers' own
    eager maps (2e-5; a mixture-of-experts router's near-ties may move a few rows, by less than 1e-3) and Lookback
    Lens fits and scores, or halwatch refuses it in one line naming it. Never a traceback. Architectures
    transformers itself cannot build or run with small sizes are counted apart."""
    from halwatch.eval.architectures import build, causal_lm_types, outcome

    by_length = probe_by_size
    train = [s for s in by_length if s.label][:3] + [s for s in by_length if not s.label][:3]
    held_out = [s for s in by_length if s not in train][:3]
    seen = {"works": [], "refused": [], "not built": []}
    for model_type in causal_lm_types():
        model = build(model_type, smol.tokenizer)
        if isinstance(model, str):
            seen["not built"].append(model_type)
            continue
        result, why = outcome(model, train, held_out)
        seen[result].append(model_type)
        if result == "refused":
            assert "\n" not in why and f"model_type '{model_type}'" in why and type(model.model).__name__ in why
            # refused for good: the model keeps its own attention, and asking again gives the same line
            assert model.model.config._attn_implementation != forward.ATTN_IMPLEMENTATION
            assert outcome(model, train, held_out) == (result, why)
            continue
        heads = model.all_heads()
        scorer = Scorer(model=model, max_tokens=300, cache=None)
        view = scorer.encode(held_out[0])
        maps = _eager_maps(model, view)
        rows = scorer.signals(held_out[:1], SignalRequest(heads=heads, attention_from="all", keep_attention=True))[0]
        gap = np.abs(rows.attention - np.stack([maps[layer][head] for layer, head in heads]))
        # equal to 2e-5 row by row; a mixture-of-experts router (solar_open's grouped top-k) may send a token whose
        # experts tie to rounding (our SDPA pass against the eager one) to another expert on some CPUs, which moves
        # that token's rows in later layers a little: a few rows may differ, none by 1e-3. A capture that gets the
        # attention wrong (scaling, soft-capping, masks) moves every row, and by more.
        moved = (gap.max(axis=2) > 2e-5).mean()
        assert moved <= 0.02 and gap.max() < 1e-3, (model_type, moved, gap.max())
    assert {"llama", "mistral", "qwen2", "gemma2", "phi3", "gpt2", "gpt_neox", "olmo2"} <= set(seen["works"])
    # bidirectional encoders, attention sinks, attention outside transformers' interface: refused, not scored wrong
    assert {"bert", "roberta", "gpt_oss", "bloom", "mamba"} <= set(seen["refused"])
    assert len(seen["works"]) >= 60, seen
