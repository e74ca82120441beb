"""The GPU kernels (Triton) of the signals against the NumPy references and the torch paths they replace:
:mod:`halwatch.signals.prim_kernel` (Prim's algorithm for MTop-Div, against :func:`halwatch.signals.topology.mtopdiv`,
itself checked against ripser, and the torch loop), :mod:`halwatch.signals.rows_kernel` (a layer's attention rows
reduced without being made, against the rows made with explicit softmaxes here and the torch reducers on them, which
``test_forward.py`` checks against the NumPy references; then MTop-Div finished on both) and
:mod:`halwatch.signals.stats_kernel` (the token statistics, against float64 softmaxes and the torch loop).

Triton is not a dependency (the CPU wheels of torch do not bring it): these run on a CUDA GPU, or in Triton's
interpreter on a CPU where Triton is installed (in a process of their own: the interpreter is chosen before Triton is
imported), and are skipped elsewhere. On a GPU a last test compares whole scoring passes of the default model with the
kernels and without them; without one, both kernels are compiled for a Hopper GPU where Triton's NVIDIA backend is
installed."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from halwatch.models import forward
from halwatch.signals import prim_kernel, reducers, rows_kernel, stats_kernel, triton_kernels
from halwatch.signals.reducers import REDUCERS, Rows
from halwatch.signals.topology import mtopdiv

NAMES = ("lookback", "diag", "sink", "mtopdiv")


def _on_device_or_interpreted(name: str, *args) -> None:
    """Run check ``name`` on the GPU here, or on the CPU in a process of its own under Triton's interpreter."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        globals()[name]("cuda", *args)
        return
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, __file__, name, *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr


def _causal(rng, heads, n, scale):
    logits = rng.normal(size=(heads, n, n)) * scale
    logits[:, np.triu(np.ones((n, n), dtype=bool), 1)] = -np.inf
    att = np.exp(logits - logits.max(-1, keepdims=True))
    return att / att.sum(-1, keepdims=True)


def _trees(rng, heads, shapes, scale):
    """Prim's inputs for samples of ``(n_prompt, n_response)`` padded to the longest response, as the MTop-Div
    reducer builds them, and each sample's NumPy reference."""
    n = max(r for _, r in shapes)
    dist = np.ones((len(shapes), heads, n, n), dtype=np.float32)
    weights = rng.random((len(shapes), heads, n, n)).astype(np.float32)  # padding: anything
    key = np.ones((len(shapes), heads, n), dtype=np.float32)
    blocked = np.full((len(shapes), heads, n), np.inf, dtype=np.float32)
    refs = []
    for b, (p, r) in enumerate(shapes):
        rows = _causal(rng, heads, p + r, scale)[:, p:]  # [H, R, p + R]
        block = rows[:, :, p:]
        dist[b, :, :r, :r] = 1.0 - np.maximum(block, block.transpose(0, 2, 1))
        weights[b, :, :r, :r] = np.maximum(block, block.transpose(0, 2, 1))  # as the MTop-Div reducer keeps them
        key[b, :, :r] = 1.0 - rows[:, :, :p].max(-1)
        blocked[b, :, :r] = 0.0
        refs.append(mtopdiv(rows, p).token_weights)
    flat = [torch.from_numpy(a.reshape(len(shapes) * heads, *a.shape[2:])) for a in (dist, key, blocked, weights)]
    return flat, refs, n


@pytest.mark.parametrize("seed,scale", [(0, 1.0), (1, 4.0), (2, 0.3)])
def test_kernel_equals_the_numpy_reference_and_the_torch_loop(seed, scale):
    _on_device_or_interpreted("check_equal", seed, scale)


def test_reducer_path_uses_the_kernel_on_a_gpu_and_falls_back_by_name():
    _on_device_or_interpreted("check_dispatch")


def check_equal(device, seed, scale):
    seed, scale = int(seed), float(scale)
    rng = np.random.default_rng(seed)
    shapes = [(5, 17), (12, 3), (1, 9), (30, 1), (7, 12)]
    heads = 3
    (dist, key, blocked, weights), refs, n = _trees(rng, heads, shapes, scale)
    loop = reducers._prim(dist, key, blocked).reshape(len(shapes), heads, n)  # CPU: the torch loop
    for given, of_weights in ((dist, False), (weights, True)):
        got = prim_kernel.prim(given.to(device), key.to(device), blocked.to(device), weights=of_weights)
        got = got.cpu().reshape(len(shapes), heads, n)
        if of_weights:  # distances made in float32 here, in float64 for the loop's: rounding apart
            np.testing.assert_allclose(got.numpy(), loop.numpy(), atol=1e-6)
        else:  # the same picks on the same numbers: equal
            np.testing.assert_array_equal(got.numpy(), loop.numpy())
        for b, (_, r) in enumerate(shapes):
            np.testing.assert_allclose(got[b, :, :r].numpy(), refs[b], atol=1e-6)
            assert not got[b, :, r:].any()  # padding: 0


def check_dispatch(device):
    rng = np.random.default_rng(3)
    (dist, key, blocked, weights), refs, n = _trees(rng, 2, [(4, 6), (3, 2)], 2.0)
    want = reducers._prim(dist, key, blocked)
    torch.testing.assert_close(reducers._prim(weights, key, blocked, weights=True), want, atol=1e-6, rtol=0)
    real = prim_kernel.prim
    calls, warned = [], []
    prim_kernel.prim = lambda *a, **k: calls.append(1) or real(*a, **k)
    triton_kernels.log.warning = lambda *a: warned.append(a[0] % a[1:])
    try:
        if device == "cuda":
            got = reducers._prim(dist.cuda(), key.cuda(), blocked.cuda()).cpu()
            assert calls and torch.equal(got, want)

            def broken(*a, **k):
                raise RuntimeError("no compiler for this device")

            prim_kernel.prim = broken
            got = reducers._prim(dist.cuda(), key.cuda(), blocked.cuda()).cpu()
            assert torch.equal(got, want)
            assert warned == ["Prim's algorithm falls back to the torch loop: RuntimeError: no compiler for "
                              "this device"]
            assert prim_kernel.KERNEL.get() is None  # once: the loop from now on
        else:  # a CPU tensor never takes the kernel, even with Triton installed
            assert torch.equal(reducers._prim(dist, key, blocked), want) and not calls and not warned
    finally:
        prim_kernel.prim = real
        del triton_kernels.log.warning
        prim_kernel.KERNEL.reset()


@pytest.mark.parametrize("seed,heads,kv,dtype", [(0, 6, 2, "float32"), (1, 4, 4, "float32"),
                                                  (2, 6, 3, "bfloat16")])
def test_statistics_equal_the_torch_reducers(seed, heads, kv, dtype):
    _on_device_or_interpreted("check_statistics", seed, heads, kv, dtype)


def check_statistics(device, seed, heads, kv, dtype):
    seed, heads, kv = int(seed), int(heads), int(kv)
    dtype = getattr(torch, dtype)
    if device == "cpu" and dtype != torch.float32:
        dtype = torch.float32  # the interpreter's products are NumPy's
    gen = torch.Generator().manual_seed(seed)
    # (n_prompt, n_header, length): responses of 1 to 70 tokens, one prompt of one token, right padding
    layout = [(40, 3, 95), (1, 0, 9), (70, 5, 140), (12, 1, 13), (33, 2, 60)]
    longest, d_head, scaling = max(n for _, _, n in layout), 32, 32 ** -0.5
    query = (torch.randn(len(layout), longest, heads, d_head, generator=gen) * 2).to(dtype)
    key = (torch.randn(len(layout), longest, kv, d_head, generator=gen) * 2).to(dtype)
    query, key = query.transpose(1, 2), key.transpose(1, 2)  # [B, H, T, D] views, as the layers hand them over
    chosen = [h for h in range(heads) if h != 1]  # a subset of the heads, in the capture's order
    rows = Rows(tuple(p for p, _, _ in layout), tuple(h for _, h, _ in layout),
                tuple(p - 1 for p, _, _ in layout), tuple(n for _, _, n in layout))
    # the reference: each sample's rows from its own softmax, on the CPU in float64, laid out as the capture does
    r_max = rows.r_max
    probs = torch.zeros(len(layout), len(chosen), r_max + 1, longest, dtype=torch.float64)
    for b, (p, _, n) in enumerate(layout):
        q = query[b, chosen, :n].double()
        k = key[b, [h // (heads // kv) for h in chosen], :n].double()
        scores = (q @ k.transpose(1, 2) * scaling).masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
        w = torch.softmax(scores, -1)[:, p - 1:]
        probs[b, :, : w.shape[1], :n] = w
        probs[b, :, w.shape[1]:, :n] = w[:, -1:]  # rows past the last query repeat it, as in the capture
    rows.probs = probs.float()
    want = {name: REDUCERS[name].fn(rows) for name in NAMES}
    rows.probs = None
    rows.device = torch.device(device)
    lay = {name: torch.tensor(getattr(rows, name) if name != "n_ctx" else
                              [p - max(h, 1) for p, h in zip(rows.n_prompt, rows.n_header)],
                              dtype=torch.int32, device=device) for name in ("n_prompt", "n_ctx", "length")}
    stats = rows_kernel.rows(query.to(device), key.to(device), torch.tensor(chosen, dtype=torch.int32, device=device),
                             lay["n_prompt"], lay["n_ctx"], lay["length"], r_max, scaling)
    got = reducers.from_statistics(rows, stats, NAMES)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    for b, (p, _, n) in enumerate(layout):
        r = n - p
        for name, field in (("lookback", "ratio"), ("diag", "w"), ("sink", "w"), ("mtopdiv", "key")):
            np.testing.assert_allclose(got[name][field][b, :, :r].cpu().numpy(), want[name][field][b, :, :r].numpy(),
                                       atol=tol, err_msg=f"{name}.{field}, sample {b}")
        np.testing.assert_allclose(1.0 - got["mtopdiv"]["block"][b, :, :r, :r].clamp(0, 1).cpu().numpy(),
                                   want["mtopdiv"]["dist"][b, :, :r, :r].numpy(), atol=tol)
    cpu = {k: {f: t.cpu() for f, t in out.items()} for k, out in (("got", got["mtopdiv"]), ("want", want["mtopdiv"]))}
    done = {k: REDUCERS["mtopdiv"].finish([out]) for k, out in cpu.items()}
    for b, (p, _, n) in enumerate(layout):
        np.testing.assert_allclose(done["got"]["token_weights"][b, :, : n - p],
                                   done["want"]["token_weights"][b, :, : n - p], atol=tol)
    np.testing.assert_allclose(done["got"]["d"], done["want"]["d"], atol=tol)
    # layers of one batch from both paths (the kernel dropped half-way): finished together all the same
    mixed = REDUCERS["mtopdiv"].finish([cpu["want"], cpu["got"]])
    alike = REDUCERS["mtopdiv"].finish([cpu["want"], cpu["want"]])
    np.testing.assert_allclose(mixed["d"], alike["d"], atol=tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_token_statistics_equal_float64_softmaxes_and_the_torch_loop(dtype):
    _on_device_or_interpreted("check_token_stats", dtype)


def check_token_stats(device, dtype):
    from types import SimpleNamespace

    dtype = getattr(torch, dtype)
    if device == "cpu":
        dtype = torch.float32  # the interpreter's arithmetic is NumPy's, which has no bfloat16
    gen = torch.Generator().manual_seed(0)
    vocab, first_logit = 5000, 7  # more than two of the kernel's blocks, the last one partial
    # (n_prompt, length) of three answers, right-padded; the logits begin at absolute position first_logit
    layout = [(10, 30), (8, 9), (20, 36)]
    longest = max(n for _, n in layout)
    logits = (torch.randn(len(layout), longest - first_logit, vocab, generator=gen) * 4).to(dtype)
    logits[0, 5, :100] = -30.0  # a row with a spread of values
    views = [SimpleNamespace(n_prompt=p, n_response=n - p,
                             input_ids=list(torch.randint(vocab, (n,), generator=gen).tolist())) for p, n in layout]
    sample = torch.tensor([b for b, v in enumerate(views) for _ in range(v.n_response)])
    position = torch.tensor([p - 1 - first_logit for v in views for p in range(v.n_prompt, len(v.input_ids))])
    target = torch.tensor([t for v in views for t in v.input_ids[v.n_prompt:]])
    logp = torch.log_softmax(logits[sample, position].double(), -1)  # the reference, in float64
    want = logp.gather(1, target[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    on = [t.to(device) for t in (logits, sample, position, target)]
    got = stats_kernel.token_stats(*on)
    stats_kernel.KERNEL.drop(RuntimeError("the loop, for the comparison"))
    try:
        loop = forward.token_stats(on[0], views, first_logit, *on[1:])
    finally:
        stats_kernel.KERNEL.reset()
    for a, b, c in zip(got, loop, want):
        assert a.dtype == torch.float32 and a.shape == (sum(v.n_response for v in views),)
        np.testing.assert_allclose(a.cpu().numpy(), c.numpy(), rtol=1e-5, atol=2e-5)
        np.testing.assert_allclose(b.cpu().numpy(), c.numpy(), rtol=1e-5, atol=2e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a whole pass on a GPU")
def test_scoring_passes_with_and_without_the_kernels_agree(probe, monkeypatch):
    """The default detector's signals of real answers on a GPU, through both kernels and through the torch paths."""
    pytest.importorskip("triton")
    from halwatch.models.capture import Capture
    from halwatch.models.forward import whitebox_request
    from halwatch.models.loader import load_model
    from halwatch.scorer import Scorer

    scorer = Scorer(model=load_model("smollm2-135m", device="cuda", dtype="float32"), cache=None)
    request = whitebox_request(scorer.model)
    samples = probe[:6]
    fused = scorer.signals(samples, request)
    monkeypatch.setattr(Capture, "_fusable", lambda *a: False)
    monkeypatch.setattr(prim_kernel.KERNEL, "get", lambda: None)
    monkeypatch.setattr(stats_kernel.KERNEL, "get", lambda: None)
    plain = scorer.signals(samples, request)
    for a, b in zip(fused, plain):
        for name in a.reduced:
            np.testing.assert_allclose(a.reduced[name], b.reduced[name], atol=1e-4, err_msg=name)
        for name in ("logprobs", "entropy"):
            np.testing.assert_allclose(getattr(a, name), getattr(b, name), atol=1e-4, err_msg=name)

@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels run")
def test_kernels_compile_for_a_hopper_gpu():
    """Without a GPU, each kernel in each of its variants through Triton's whole NVIDIA pipeline (its Python front end
    to machine code for an H100), which the interpreter skips."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this Triton has no NVIDIA backend")
    target = GPUTarget("cuda", 90, 32)
    ints = ("sq_b", "sq_h", "sq_t", "sq_d", "sk_b", "sk_h", "sk_t", "sk_d", "n_heads", "group", "r_max", "d_head")
    for dtype, ieee in (("*bf16", False), ("*fp32", True)):
        signature = {"q_ptr": dtype, "k_ptr": dtype, **{f"{n}_ptr": "*i32" for n in ("heads", "n_prompt", "n_ctx",
                                                                                     "length")},
                     **{f"{n}_ptr": "*fp32" for n in ("ratio", "root", "diag", "sink", "block")},
                     **dict.fromkeys(ints, "i32"), "scale": "fp32",
                     **dict.fromkeys(("BLOCK_Q", "BLOCK_K", "BLOCK_D", "IEEE"), "constexpr")}
        signature = {name: signature[name] for name in rows_kernel.KERNEL.get().arg_names}
        tiles = {"BLOCK_Q": rows_kernel.BLOCK_Q, "BLOCK_K": rows_kernel.BLOCK_K, "BLOCK_D": 64, "IEEE": ieee}
        built = triton.compile(ASTSource(rows_kernel.KERNEL.get(), signature, constexprs=tiles), target=target)
        assert built.asm["cubin"]
    for weights in (False, True):
        signature = {"dist_ptr": "*fp32", "key_ptr": "*fp32", "blocked_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32",
                     "WEIGHTS": "constexpr", "BLOCK": "constexpr"}
        built = triton.compile(ASTSource(prim_kernel.KERNEL.get(), signature,
                                         constexprs={"WEIGHTS": weights, "BLOCK": 256}), target=target)
        assert built.asm["cubin"]
    for dtype in ("*bf16", "*fp32"):
        signature = {"logits_ptr": dtype, **{f"{n}_ptr": "*i64" for n in ("sample", "position", "target")},
                     "logprob_ptr": "*fp32", "entropy_ptr": "*fp32", "vocab": "i32", "stride_b": "i32",
                     "stride_p": "i32", "BLOCK": "constexpr"}
        built = triton.compile(ASTSource(stats_kernel.KERNEL.get(), signature,
                                         constexprs={"BLOCK": stats_kernel.BLOCK}), target=target)
        assert built.asm["cubin"]


if __name__ == "__main__":  # one check in this process: python tests/test_kernels.py NAME ARGS...
    globals()[sys.argv[1]]("cuda" if torch.cuda.is_available() else "cpu", *sys.argv[2:])
