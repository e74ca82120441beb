"""The Triton kernel of Prim's algorithm (:mod:`halwatch.signals.prim_kernel`) against the NumPy MTop-Div reference
(:func:`halwatch.signals.topology.mtopdiv`, itself checked against ripser) and the torch loop it replaces on a GPU.

Triton is not a dependency (the CPU wheels of torch do not bring it): these tests run on a CUDA GPU, or in Triton's
interpreter on a CPU where Triton is installed, and are skipped elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from halwatch.signals import prim_kernel, reducers, triton_kernels
from halwatch.signals.topology import mtopdiv


def _on_device_or_interpreted(name: str, *args) -> None:
    """Run check ``name`` on the GPU here, or on the CPU in a process of its own under Triton's interpreter (which
    must be chosen before Triton is first imported)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        globals()[name]("cuda", *args)
        return
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, __file__, name, *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=600)
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
    torch.testing.assert_close(reducers._prim_of_weights(weights, key, blocked), want, atol=1e-6, rtol=0)
    real = prim_kernel.prim
    calls, warned = [], []
    prim_kernel.prim = lambda *a: calls.append(1) or real(*a)
    triton_kernels.log.warning = lambda *a: warned.append(a[0] % a[1:])
    try:
        if device == "cuda":
            got = reducers._prim(dist.cuda(), key.cuda(), blocked.cuda()).cpu()
            assert calls and torch.equal(got, want)

            def broken(*a):
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


if __name__ == "__main__":  # one check in this process: python tests/test_prim_kernel.py NAME ARGS...
    globals()[sys.argv[1]]("cuda" if torch.cuda.is_available() else "cpu", *sys.argv[2:])
