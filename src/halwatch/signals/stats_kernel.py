"""The token statistics of a batch in one GPU launch (Triton): for every response token, the log-probability of that
token and the entropy of the next-token distribution that predicts it.

The torch path (:func:`halwatch.models.forward.batch_outputs`) normalises each answer's rows of logits in turn: a
float32 copy of the rows, ``log_softmax``, a gather, ``exp``, a product and a sum, half a dozen launches per answer
and five passes over rows of the whole vocabulary. On an H100 they took 77 ms of device time per 256 RAGTruth
answers, and a few thousand launches of host time.

Here one program reads one row once, in blocks of the vocabulary, and keeps three running numbers (an online
softmax): the row's maximum ``m``, ``s = sum exp(x - m)`` and ``t = sum exp(x - m) x``. Then

    log p(target) = x_target - lse,    entropy = -sum p log p = lse - t / s,    lse = m + log s.

The numbers are the torch path's to float32 rounding; that path stays the reference, the CPU path and the
fallback where Triton is missing or cannot compile for the device.
"""

from __future__ import annotations

from halwatch.signals.triton_kernels import Kernel, launching_on


def _make():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["vocab", "stride_b", "stride_p"])
    def stats_kernel(logits_ptr, sample_ptr, position_ptr, target_ptr, logprob_ptr, entropy_ptr, vocab,
                     stride_b, stride_p, BLOCK: tl.constexpr):
        token = tl.program_id(0)
        row = (logits_ptr + tl.load(sample_ptr + token).to(tl.int64) * stride_b
               + tl.load(position_ptr + token).to(tl.int64) * stride_p)
        offs = tl.arange(0, BLOCK)
        m = float("-inf")
        s = 0.0
        t = 0.0
        for start in range(0, vocab, BLOCK):
            inside = start + offs < vocab
            x = tl.load(row + start + offs, mask=inside, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            e = tl.exp(x - m_new)
            rescale = tl.exp(m - m_new)
            s = s * rescale + tl.sum(e, axis=0)
            t = t * rescale + tl.sum(tl.where(e > 0.0, e * x, 0.0), axis=0)  # not 0 * -inf
            m = m_new
        lse = m + tl.log(s)
        x_target = tl.load(row + tl.load(target_ptr + token)).to(tl.float32)
        tl.store(logprob_ptr + token, x_target - lse)
        tl.store(entropy_ptr + token, lse - t / s)

    return stats_kernel


KERNEL = Kernel(_make, "the token statistics fall back to torch")

#: Vocabulary entries a program reads per step.
BLOCK = 2048


def token_stats(logits, sample, position, target):
    """``(log-probabilities, entropies)``, float32 ``[S]``: for each of ``S`` response tokens, row ``position[s]``
    of answer ``sample[s]`` of ``logits [B, P, V]`` (the distribution that predicts the token) and the token's id
    ``target[s]`` (all three long tensors on the logits' device). Raises where Triton cannot run here (the caller
    falls back)."""
    import torch

    run = KERNEL.get()
    if run is None:
        raise RuntimeError("Triton is not installed")
    n = len(target)
    logprob = torch.empty(n, dtype=torch.float32, device=logits.device)
    entropy = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n == 0:
        return logprob, entropy
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    with launching_on(logits.device):
        run[(n,)](logits, sample, position, target, logprob, entropy, logits.shape[-1], logits.stride(0),
                  logits.stride(1), BLOCK=BLOCK, num_warps=8)
    return logprob, entropy
