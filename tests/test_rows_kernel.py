"""The GPU kernel that reduces attention rows without making them (:mod:`halwatch.signals.rows_kernel`) against the
torch path it replaces: the rows made with explicit softmaxes here, the torch reducers on them (themselves checked
against the NumPy references in ``test_forward.py``), then MTop-Div finished on both.

Triton is not a dependency: these run on a CUDA GPU, or in Triton's interpreter on a CPU where Triton is installed
(in a process of its own, since the interpreter is chosen before Triton is imported), and are skipped elsewhere. On a
GPU a last test compares whole scoring passes of the default model with the kernel and without it."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from halwatch.signals import reducers, rows_kernel
from halwatch.signals.reducers import REDUCERS, Rows

NAMES = ("lookback", "diag", "sink", "mtopdiv")


def _on_device_or_interpreted(name: str, *args) -> None:
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        globals()[name]("cuda", *args)
        return
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, __file__, name, *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr


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
        np.testing.assert_allclose(got["mtopdiv"]["block"][b, :, :r, :r].cpu().numpy(),
                                   want["mtopdiv"]["block"][b, :, :r, :r].numpy(), atol=tol)
    done = {k: REDUCERS["mtopdiv"].finish([{f: t.cpu() for f, t in out.items()}])
            for k, out in (("got", got["mtopdiv"]), ("want", want["mtopdiv"]))}
    for b, (p, _, n) in enumerate(layout):
        np.testing.assert_allclose(done["got"]["token_weights"][b, :, : n - p],
                                   done["want"]["token_weights"][b, :, : n - p], atol=tol)
    np.testing.assert_allclose(done["got"]["d"], done["want"]["d"], atol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a whole pass on a GPU")
def test_scoring_passes_with_and_without_the_kernel_agree(probe, monkeypatch):
    """The default detector's signals of real answers on a GPU, through the kernel and through the torch path."""
    pytest.importorskip("triton")
    from halwatch.models import forward
    from halwatch.models.forward import whitebox_request
    from halwatch.models.loader import load_model
    from halwatch.scorer import Scorer

    scorer = Scorer(model=load_model("smollm2-135m", device="cuda", dtype="float32"), cache=None)
    request = whitebox_request(scorer.model)
    samples = probe[:6]
    fused = scorer.signals(samples, request)
    monkeypatch.setattr(forward._Capture, "_fusable", lambda *a: False)
    plain = scorer.signals(samples, request)
    for a, b in zip(fused, plain):
        for name in a.reduced:
            np.testing.assert_allclose(a.reduced[name], b.reduced[name], atol=1e-4, err_msg=name)


if __name__ == "__main__":  # one check in this process: python tests/test_rows_kernel.py NAME ARGS...
    globals()[sys.argv[1]]("cuda" if torch.cuda.is_available() else "cpu", *sys.argv[2:])
