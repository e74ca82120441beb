"""Triton kernels made on first use, for the GPU paths of the signals (:mod:`halwatch.signals.prim_kernel`,
:mod:`halwatch.signals.rows_kernel`, :mod:`halwatch.signals.stats_kernel`). Triton is not a dependency of halwatch:
the CUDA builds of torch bring it, the CPU builds do not. Each kernel has a torch path that stays the reference and
the fallback: where Triton is missing the kernel is never asked for, and where it fails (no compiler for the device,
say) it is dropped once, with one warning that names what takes over."""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

log = logging.getLogger("halwatch")


class Kernel:
    """``make()`` (importing Triton inside) builds the kernel at the first :meth:`get`."""

    def __init__(self, make: Callable, fallback: str):
        self.make, self.fallback = make, fallback
        self._kernel = None  # None: not made yet; False: unusable here

    def get(self):
        """The kernel, or ``None`` where Triton is not installed or the kernel was dropped."""
        if self._kernel is None:
            try:
                self._kernel = self.make()
            except ImportError:
                self._kernel = False
        return self._kernel or None

    def attempt(self, tensor, launch: Callable, *args, **kwargs):
        """``launch(*args, **kwargs)`` (the kernel's wrapper) where ``tensor`` is on a CUDA GPU and the kernel is
        here; ``None`` elsewhere, or when it fails, which drops it (:meth:`drop`): the caller's torch path takes
        over."""
        if not tensor.is_cuda or self.get() is None:
            return None
        try:
            return launch(*args, **kwargs)
        except Exception as exc:  # a Triton that cannot compile for this device, say
            self.drop(exc)
            return None

    def drop(self, exc: BaseException) -> None:
        """Stop using the kernel in this process after ``exc``, saying so once."""
        if self._kernel is not False:
            log.warning("%s: %s: %s", self.fallback, type(exc).__name__, exc)
        self._kernel = False

    def reset(self) -> None:
        """Make the kernel again at the next :meth:`get` (tests: after choosing Triton's interpreter)."""
        self._kernel = None


def launching_on(device):
    """A context in which Triton launches on ``device``: it launches on the current CUDA device, which need not be
    the tensors' (a model on ``cuda:1``)."""
    import torch

    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
