"""Eq. 7-9 mean resampling against exact references for every length pair up to 1024 -> 512, the (0, 1)
normalisation of sections 4.2 and 4.4, and the relevance rules' warning on modules they do not recognise."""

from __future__ import annotations

import logging
import math
from fractions import Fraction

import numpy as np
import pytest

from halwatch.signals.relevance import normalise, resample, resample_bounds, resample_matrix

MAX_OLD, MAX_NEW = 1024, 512


def _reference_rows(n_old: int, n_new: int) -> list[tuple[int, int, Fraction]]:
    """Eq. 8-9 in exact rational arithmetic: ``(start, end, weight)`` of each new value, ``rho = n_old / n_new`` as
    a Fraction; an empty range (stretching) takes the old value at its start."""
    rho = Fraction(n_old, n_new)
    rows = []
    for i in range(n_new):
        start, end = math.floor(i * rho), math.floor((i + 1) * rho)
        end = max(end, start + 1)
        rows.append((start, end, Fraction(1, end - start)))
    return rows


def test_bounds_of_every_length_pair_equal_an_exact_reference_and_cover_every_old_value():
    """All 1024 x 512 pairs at once, one new index ``i`` at a time (the pairs with ``n_new > i``). The reference is
    Bresenham's: ``floor(i n_old / n_new)`` carried from ``i`` to ``i + 1`` as a quotient and a remainder (no float,
    and no division of ``i n_old`` as in the code under test). Row ``i`` of the matrix is ``1 / (end - start)`` on
    ``end - start`` values, so it sums to 1 when its range is non-empty and inside ``[0, n_old)``; every old value
    has non-zero weight when the first range starts at 0, the last ends at ``n_old`` and consecutive ranges leave no
    gap (shrinking, they must partition the old values)."""
    n_old = np.arange(1, MAX_OLD + 1, dtype=np.int64)[:, None]
    n_new_all = np.arange(1, MAX_NEW + 1, dtype=np.int64)[None, :]
    step_q, step_r = np.divmod(n_old, n_new_all)  # rho = step_q + step_r / n_new
    q = np.zeros((MAX_OLD, MAX_NEW), dtype=np.int64)  # floor(i rho)
    r = np.zeros_like(q)  # i n_old - q n_new, in [0, n_new)
    stretching = n_old < n_new_all
    previous_end = None
    for i in range(MAX_NEW):  # column k of the slices is n_new = i + 1 + k
        n_new = n_new_all[:, i:]
        next_q, next_r = q + step_q[:, i:], r + step_r[:, i:]
        carry = next_r >= n_new
        next_q, next_r = next_q + carry, next_r - n_new * carry
        start, end = resample_bounds(i, n_old, n_new)
        assert np.array_equal(start, q), f"start of new value {i}"
        assert np.array_equal(end, np.maximum(next_q, q + 1)), f"end of new value {i}"  # empty: the value at start
        assert np.all(end > start) and np.all(start >= 0) and np.all(end <= n_old), f"range of new value {i}"
        assert np.array_equal(end[:, 0], n_old[:, 0]), f"the last range (n_new = {i + 1}) ends early"
        if i == 0:
            assert np.all(start == 0)
        else:
            assert np.all(start <= previous_end[:, 1:]), f"old values left out before new value {i}"
            assert np.all((start == previous_end[:, 1:]) | stretching[:, i:]), f"shrinking, not a partition at {i}"
        q, r, previous_end = next_q[:, 1:], next_r[:, 1:], end


DENSE_PAIRS = ([(a, b) for a in range(1, 65) for b in range(1, 65)]
               + [(113, 100), (399, 398), (1024, 512), (1023, 512), (1024, 1), (1, 512), (997, 511), (512, 1024)])


def test_matrix_equals_the_fraction_reference():
    """The dense matrix of every pair up to 64 -> 64 and some large ones (113 -> 100 lost its last token in floating
    point) equals the Fraction reference value for value; rows sum to 1 and, shrinking, every column is non-zero.
    (Every pair up to 1024 -> 512 as dense matrices would be 3e10 values: the test above checks their ranges.)"""
    for n_old, n_new in DENSE_PAIRS:
        got = resample_matrix(n_old, n_new)
        expected = np.zeros((n_new, n_old))
        for i, (start, end, weight) in enumerate(_reference_rows(n_old, n_new)):
            expected[i, start:end] = float(weight)
        assert np.array_equal(got, expected), (n_old, n_new)
        assert np.allclose(got.sum(axis=1), 1.0, rtol=0, atol=1e-12), (n_old, n_new)
        if n_old >= n_new:
            assert np.all(got.sum(axis=0) > 0), (n_old, n_new)


def test_last_token_keeps_its_weight_113_to_100():
    values = np.zeros(113)
    values[-1] = 1.0
    assert resample(values, 100)[-1] == pytest.approx(0.5)  # the last new value is the mean of old 111 and 112
    assert resample_matrix(113, 100)[:, -1].sum() == pytest.approx(0.5)


def test_normalise_maps_to_unit_interval_with_epsilon():
    r = np.array([-2.0, 0.0, 3.0])
    assert normalise(r) == pytest.approx([0.0, 2 / (5 + 1e-6), 5 / (5 + 1e-6)], rel=1e-12)
    assert np.all((normalise(r) >= 0) & (normalise(r) < 1))
    assert normalise([4.0, 4.0]) == pytest.approx([0.0, 0.0])  # a constant vector: zeros, not a division by 0
    assert normalise([[1.0, 2.0], [3.0, 5.0]]) == pytest.approx(np.array([[0, 1], [2, 4]]) / (4 + 1e-6))


@pytest.fixture(scope="module")
def tiny_phi3(smol):
    """A random two-layer Phi-3 (fused gate_up_proj MLP) with the default tokenizer's vocabulary, built from a
    config: nothing is downloaded."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=4,
                                  vocab_size=len(smol.tokenizer))
    return AutoModelForCausalLM.from_config(config).eval()


def test_rules_warn_once_naming_unrecognised_gated_mlp(tiny_phi3, smol, scorer, caplog):
    """Phi-3's fused gate_up_proj is no Llama-pattern MLP: a relevance pass through it warns once, naming the class
    and the path; SmolLM2 (Llama) has a rule for every norm and MLP and warns nothing."""
    from halwatch.models.forward import run
    from halwatch.models.loader import ScoringModel
    from halwatch.models.relevance import RelevanceRequest, unrecognised
    from halwatch.models.signal_types import SignalRequest
    from halwatch.sample import Sample

    assert [(p, k) for p, k, _ in unrecognised(tiny_phi3)] == [("model.layers.0.mlp", "Phi3MLP"),
                                                                ("model.layers.1.mlp", "Phi3MLP")]
    assert unrecognised(smol.model) == []  # Llama: every norm and MLP has its rule
    phi3 = ScoringModel(name="tiny-phi3", path="", weights_hash="random", model=tiny_phi3, tokenizer=smol.tokenizer)
    view = scorer.encode(Sample(prompt="Context: The moon is about 384,000 km from the Earth.\nQuestion: How far is "
                                       "the moon?\nAnswer:", response=" About 384,000 km."))
    request = SignalRequest(relevance=RelevanceRequest(method="lrp"))
    with caplog.at_level(logging.WARNING, logger="halwatch"):
        first = run(phi3, [view], request)[0]
        run(phi3, [view], request)
    warnings = [r.getMessage() for r in caplog.records if "Phi3MLP" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once per model, one line per class
    assert "model.layers.0.mlp" in warnings[0] and "(and 1 more like it)" in warnings[0]
    assert "gate_up_proj" in warnings[0]
    assert np.all(np.isfinite(first.relevance["mean"]))


def test_rules_refuse_a_gated_mlp_whose_activation_is_a_function():
    import torch

    from halwatch.errors import HalwatchError
    from halwatch.models import relevance as lrp

    mlp = torch.nn.Module()
    mlp.gate_proj, mlp.up_proj = torch.nn.Linear(2, 3), torch.nn.Linear(2, 3)
    mlp.act_fn = torch.nn.functional.silu
    with pytest.raises(HalwatchError, match="act_fn is not a module"):
        with lrp.rules(mlp, "lrp"):
            pass
    with lrp.rules(mlp, "ixg"):  # Input x Gradient needs no rule
        assert lrp.active() == "ixg"
