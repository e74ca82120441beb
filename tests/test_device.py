"""Device and precision choices (``--device``, ``--dtype``), checked on the CPU: what a machine lacks is refused by
name, bfloat16 scoring works and is cached apart from float32, and a detector fitted in one precision (the default:
bfloat16) warns when it scores another. Batches chosen by a token budget."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from halwatch.detectors import load_detector
from halwatch.errors import ModelError
from halwatch.models import loader
from halwatch.models.forward import whitebox_request
from halwatch.models.loader import cpu_computes_bfloat16, resolve_device, resolve_dtype
from halwatch.scorer import Scorer


def test_devices_and_dtypes_are_checked(monkeypatch):
    assert resolve_device("cpu") == "cpu"
    if torch.cuda.is_available():
        monkeypatch.delenv("HALWATCH_DTYPE")  # the session's float32 pin (conftest)
        assert resolve_device("auto") == "cuda:0" and resolve_dtype("auto", "cuda:0") in ("bfloat16", "float16")
    for bad in ("tpu", "cuda:x", "cpu:1"):
        with pytest.raises(ModelError, match=f"unknown device '{bad}'"):
            resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ModelError, match="no CUDA GPU"):
            resolve_device("cuda:0")
        assert resolve_device("auto") in ("cpu", "mps")
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
    with pytest.raises(ModelError, match="unknown dtype 'int8'"):
        resolve_dtype("int8", "cpu")


def test_auto_picks_bfloat16_on_a_cpu_that_computes_it(tmp_path, monkeypatch):
    flags = "flags\t\t: fpu vme sse sse2 avx2 avx512f avx512bw"
    plain, native = tmp_path / "plain", tmp_path / "native"
    plain.write_text(f"processor\t: 0\n{flags}\n\nprocessor\t: 1\n{flags}\n")
    native.write_text(f"processor\t: 0\n{flags} avx512_bf16 avx512_vnni\n")
    assert not cpu_computes_bfloat16(plain) and cpu_computes_bfloat16(native)
    assert not cpu_computes_bfloat16(tmp_path / "missing")  # not Linux: float32, as before
    # the test session pins float32 (conftest); unset (or auto), auto follows the CPU's instructions
    assert resolve_dtype("auto", "cpu") == "float32"
    for unset in (None, "auto"):
        if unset is None:
            monkeypatch.delenv("HALWATCH_DTYPE")
        else:
            monkeypatch.setenv("HALWATCH_DTYPE", unset)
        for native in (True, False):
            monkeypatch.setattr(loader, "cpu_computes_bfloat16", lambda native=native: native)
            assert resolve_dtype("auto", "cpu") == ("bfloat16" if native else "float32")
            assert resolve_dtype("auto", "mps") == "float16" and resolve_dtype("float32", "cpu") == "float32"
    monkeypatch.setenv("HALWATCH_DTYPE", "bfloat16")
    assert resolve_dtype("auto", "cpu") == "bfloat16" and resolve_dtype("float32", "cpu") == "float32"
    monkeypatch.setenv("HALWATCH_DTYPE", "half")
    with pytest.raises(ModelError, match="HALWATCH_DTYPE='half'"):
        resolve_dtype("auto", "cpu")


@pytest.mark.skipif(not cpu_computes_bfloat16() or torch.cuda.is_available(),
                    reason="needs a CPU with bfloat16 instructions and no GPU")
def test_the_default_command_scores_in_bfloat16_on_such_a_cpu(halwatch, monkeypatch, caplog):
    monkeypatch.delenv("HALWATCH_DTYPE")
    args = ("score", "--context", "Insulin is made by the beta cells of the pancreas.",
            "--question", "What makes insulin?", "--response", "The beta cells of the pancreas make insulin.")
    with caplog.at_level(logging.WARNING, logger="halwatch"):
        done = halwatch(*args)
    assert '"hallucinated": false' in done.stdout
    assert not [r for r in caplog.records if "signals and scores" in r.getMessage()]  # fitted as it runs
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="halwatch"):
        pinned = halwatch(*args, "--dtype", "float32")
    warned = [r.getMessage() for r in caplog.records if "scores float32 ones" in r.getMessage()]
    assert len(warned) == 1 and "--dtype bfloat16 scores as it was fitted" in warned[0], warned
    assert json.loads(pinned.stdout)["score"] != json.loads(done.stdout)["score"]  # they differ in the last places


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_the_command_refuses_a_device_this_machine_lacks(halwatch):
    done = halwatch("score", "--device", "cuda", "--context", "a", "--question", "b", "--response", "c", check=False)
    assert done.returncode != 0 and "no CUDA GPU" in done.stderr
    bad = halwatch("score", "--batch-size", "0", "--response", "c", check=False)
    assert bad.returncode == 2 and "must be at least 1" in bad.stderr


def test_bfloat16_scores_are_cached_apart_and_float32_ones_warn_against_a_bfloat16_fit(smol, probe_by_size,
                                                                                       tmp_path, caplog):
    # the two shortest answers: bfloat16 matrix products are slow on a CPU without native support (minutes for four)
    samples = probe_by_size[:2]
    half = Scorer(model="smollm2-135m", device="cpu", dtype="bfloat16", cache=tmp_path, max_tokens=512)
    full = Scorer(model=smol, cache=tmp_path, max_tokens=512)
    assert half.model.dtype == "bfloat16" and half.model.device.type == "cpu"
    assert half.identity()["dtype"] == "bfloat16" and full.identity()["dtype"] == "float32"
    view, request = full.encode(samples[0]), whitebox_request(smol)
    assert half.cache_key(view, request) != full.cache_key(view, request)
    with caplog.at_level(logging.WARNING, logger="halwatch"):
        det_full = load_detector("default", scorer=full)
    warned = [r.getMessage() for r in caplog.records
              if "fitted on bfloat16 signals and scores float32" in r.getMessage()]
    assert len(warned) == 1 and "'routed'" in warned[0], warned  # one warning for the default, not one per part
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="halwatch"):
        det_half = load_detector("default", scorer=half)
    assert not [r for r in caplog.records if "signals and scores" in r.getMessage()]
    a, b = det_half.score(samples), det_full.score(samples)
    assert np.all(np.isfinite(a)) and np.max(np.abs(a - b)) < 0.05, (a, b)
    lp_half = half.signals(samples[:1], request)[0].logprobs
    lp_full = full.signals(samples[:1], request)[0].logprobs
    assert 0 < np.max(np.abs(lp_half - lp_full)) < 1.0  # the precision differs, the model does not
    n_views = sum(len(full.encode_windows(s)) for s in samples)  # a context over the cap: one entry per window
    assert len(list(tmp_path.rglob("*.npz"))) == 2 * n_views  # each precision has its own entries


def test_a_detector_that_makes_its_own_scorer_warns_too(probe_by_size, monkeypatch, caplog):
    """Loaded without a scorer, a detector makes one from its artifact on first use; where `auto` then picks
    another precision than the fitted one, it warns as the command does."""
    monkeypatch.setenv("HALWATCH_DTYPE", "float32")  # the session's pin, named: the default was fitted in bfloat16
    det = load_detector("default")
    with caplog.at_level(logging.WARNING, logger="halwatch"):
        p = det.score(probe_by_size[:1])
    warned = [r.getMessage() for r in caplog.records if "scores float32 ones" in r.getMessage()]
    assert len(warned) == 1 and "'routed'" in warned[0] and 0 <= p[0] <= 1, warned
    assert det.scorer.identity()["dtype"] == "float32"


def test_batches_by_token_budget(smol):
    scorer = Scorer(model=smol, batch_size=None, batch_tokens=1000, cache=None)
    assert scorer.batches([100, 200, 300, 400, 500]) == [[0, 1, 2], [3, 4]]  # 3 x 300 <= 1000 < 4 x 400
    assert scorer.batches([2000]) == [[0]]  # one answer over the budget still runs, alone
    scorer.batch_size = 2
    assert scorer.batches([100, 200, 300, 400, 500]) == [[0, 1], [2, 3], [4]]
