"""Where the scoring path's time goes (``halwatch bench speed --parts phases``): the steps of the one pass and of
the detectors are marked with :func:`timed`, and while a :class:`Timer` is active in the calling thread each marked
call adds its seconds to its label (the device synchronised before and after). With no timer active a marked call
costs one context-variable read."""

from __future__ import annotations

import contextvars
import functools
import time
from collections import defaultdict

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("halwatch_timer", default=None)


class Timer:
    """Seconds per label of the :func:`timed` calls made while it is active (``with Timer(sync) as t: ...``).
    ``sync``: called before and after each timed call (a device's synchronize), so that asynchronous work is
    counted where it runs."""

    def __init__(self, sync=None):
        self.spent: dict[str, float] = defaultdict(float)
        self.sync = sync or (lambda: None)
        self._token = None

    def __enter__(self) -> "Timer":
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self._token)


def active() -> Timer | None:
    """The timer active in this context, if any."""
    return _ACTIVE.get()


def timed(label: str):
    """Mark a function as a step of the scoring path named ``label`` (see the module docstring)."""
    def mark(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            timer = _ACTIVE.get()
            if timer is None:
                return fn(*args, **kwargs)
            timer.sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timer.sync()
                timer.spent[label] += time.perf_counter() - t0
        return run
    return mark


def sync() -> None:
    """Wait for queued GPU work, so that a GPU's asynchronous kernels are timed, not only launched."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
