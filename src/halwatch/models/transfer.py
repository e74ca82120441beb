"""Copies between the host and the device through page-locked buffers kept per thread."""

from __future__ import annotations

import threading

import numpy as np

from halwatch.timing import timed

#: Per thread, the page-locked buffers that :func:`to_host` and :func:`upload` copy through, grown as needed and
#: kept: allocating page-locked memory costs milliseconds per call (5.7 ms each on an H200 host), a batch's worth of
#: answers.
_STAGING = threading.local()
_UPLOADS = threading.local()  # and the event of its last copy


def _staging(nbytes: int, store=_STAGING):
    """``store``'s page-locked buffer of at least ``nbytes`` bytes (doubled when it grows)."""
    import torch

    buffer = getattr(store, "buffer", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = store.buffer = torch.empty(max(nbytes, 2 * (0 if buffer is None else buffer.numel())),
                                            dtype=torch.uint8, pin_memory=True)
    return buffer


@timed("copies off the device")
def to_host(tensors: dict) -> dict:
    """``{name: numpy array}`` of ``{name: tensor}``: from a GPU through this thread's page-locked buffer, all
    copies queued before one wait (a copy into ordinary memory runs at a fraction of the bus's speed and waits each
    time). The arrays of a GPU's tensors are views of that buffer, valid until this thread's next call: copy what
    is kept."""
    import torch

    devices = {t.device.type for t in tensors.values()}
    if devices != {"cuda"}:
        return {k: t.cpu().numpy() for k, t in tensors.items()}
    tensors = {k: t.contiguous() for k, t in tensors.items()}
    starts, end = {}, 0
    for k, t in tensors.items():
        starts[k] = end
        end += -(-t.numel() * t.element_size() // 64) * 64  # every array 64-byte aligned
    buffer = _staging(end)
    host = {}
    for k, t in tensors.items():
        host[k] = buffer[starts[k]:starts[k] + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        host[k].copy_(t, non_blocking=True)
    torch.cuda.current_stream(next(iter(tensors.values())).device).synchronize()
    return {k: t.numpy() for k, t in host.items()}


def upload(arrays, device):
    """``arrays`` (one array, or a list of arrays stacked along their first axis: ``[R_i, ...]`` each) as one tensor
    on ``device``, copied without a wait. On a GPU the arrays are copied straight into this thread's page-locked
    buffer (grown as needed and kept), never joined in ordinary memory first: a copy from ordinary memory runs at a
    fraction of the bus's speed (on an H100 the token model's inputs took 54 ms of device time per 256 answers that
    way). The buffer is refilled only once its last copy is done."""
    import torch

    parts = [arrays] if isinstance(arrays, np.ndarray) else list(arrays)
    if device.type != "cuda":
        return torch.from_numpy(np.concatenate(parts) if len(parts) > 1 else np.ascontiguousarray(parts[0])).to(device)
    if getattr(_UPLOADS, "event", None) is not None:
        _UPLOADS.event.synchronize()
    first = torch.from_numpy(np.ascontiguousarray(parts[0][:0]))
    shape = (sum(len(p) for p in parts), *first.shape[1:])
    nbytes = int(np.prod(shape)) * first.element_size()
    staged = _staging(nbytes, _UPLOADS)[:nbytes].view(first.dtype).view(shape)
    row = 0
    for part in parts:
        staged[row:row + len(part)].copy_(torch.from_numpy(np.ascontiguousarray(part)))
        row += len(part)
    out = staged.to(device, non_blocking=True)
    _UPLOADS.event = torch.cuda.Event()
    _UPLOADS.event.record(torch.cuda.current_stream(device))
    return out
