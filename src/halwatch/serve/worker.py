"""The one thread that runs a server's model work, with admission control by tokens of model work."""

from __future__ import annotations

import asyncio
import collections
import math

from halwatch.errors import HalwatchError
from halwatch.serve.common import ApiError


class Worker:
    """The one thread that runs a server's model work, in the order it comes, with admission control by cost (tokens
    of model work): a request is admitted only when it fits the queue (``capacity``) and, by the seconds per token
    measured on finished work, can be answered within ``deadline`` seconds; otherwise it is refused at once, 429
    with an honest ``Retry-After`` (when the queue ahead will have drained enough), or 413 when it is larger than
    the whole queue. :attr:`queued` is the cost admitted and not yet finished."""

    #: The share of the time limit the estimated model time may fill: the rest is for what the estimate does not
    #: see (tokenizing, the event loop, a batch slower than the average).
    DEADLINE_SHARE = 0.8

    def __init__(self, capacity: int, deadline: float):
        from concurrent.futures import ThreadPoolExecutor

        if capacity < 1:
            raise HalwatchError(f"--queue-tokens must be at least 1, got {capacity}")
        self.capacity, self.deadline = capacity, deadline
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="halwatch-model")
        self.queued = 0
        self.recent: collections.deque = collections.deque(maxlen=self.RECENT)  # seconds per unit, measured

    #: How many finished batches the estimate reads: the slowest of them per unit of cost, so that one slow batch
    #: (a busy CPU, a long answer) is never averaged away into admitting work that then times out.
    RECENT = 8

    @property
    def rate(self) -> float | None:
        """Seconds per unit of cost: the slowest of the last :data:`RECENT` finished batches (``None`` before)."""
        return max(self.recent) if self.recent else None

    def wait(self, cost: int = 0) -> float | None:
        """Estimated seconds until ``cost`` more units admitted now would be done (``None`` before any measure)."""
        return None if self.rate is None else (self.queued + cost) * self.rate

    def admit(self, cost: int) -> None:
        """Count ``cost`` more units in, or refuse them (:meth:`check`)."""
        self.check(cost)
        self.queued += cost

    def check(self, cost: int) -> None:
        """Refuse ``cost`` more units: 413 when larger than the whole queue, 429 when they do not fit now or would
        finish past the deadline. (A lower bound of a request's cost can be checked before it is tokenized.)"""
        if cost > self.capacity:
            raise ApiError(413, f"this request needs {cost} tokens of model work, more than the whole queue "
                                f"holds ({self.capacity}, --queue-tokens): send fewer or shorter items",
                           "request_too_large")
        alone, budget = cost * (self.rate or 0.0), self.deadline * self.DEADLINE_SHARE
        if alone > budget:
            raise ApiError(413, f"this request needs about {alone:.1f} s of model time even on an idle server, "
                                f"past the {self.deadline:g} s limit (--timeout): send fewer or shorter items",
                           "request_too_large")
        wait = self.wait(cost)
        if self.queued + cost > self.capacity:
            behind = (self.queued + cost - self.capacity) * (self.rate or 0.0)
            raise ApiError(429, f"the server is busy ({self.queued} of {self.capacity} tokens queued): retry "
                                f"later", "queue_full", headers={"Retry-After": str(max(1, math.ceil(behind)))})
        if wait is not None and wait > budget:
            raise ApiError(429, f"the server is busy: this request would be answered in about {wait:.1f} s, past "
                                f"the {self.deadline:g} s limit: retry later", "queue_full",
                           headers=self.retry_after(wait))

    def retry_after(self, wait: float) -> dict:
        """The ``Retry-After`` header of a 429 for work that would be done in ``wait`` seconds: when it would
        fit the share of the deadline that admission allows."""
        return {"Retry-After": str(max(1, math.ceil(wait - self.deadline * self.DEADLINE_SHARE)))}

    def overdue(self, waiting: list[tuple[int, float]], now: float) -> dict[int, float]:
        """``{index: estimated seconds from its admission to done}`` for the admitted work still waiting
        (``(cost, admitted at)`` in the order it will run, nothing running ahead of it) that, at the seconds per
        unit measured by now, would be done past the share of the deadline that admission allows: work admitted
        on an estimate that the batches since have proved too low (a flood slows the model thread while the event
        loop parses it). Refused at once, it is a 429 the client can act on instead of a 504 later."""
        if self.rate is None:
            return {}
        ahead, late = 0, {}
        for i, (cost, since) in enumerate(waiting):
            answered = now + (ahead + cost) * self.rate - since
            if answered > self.deadline * self.DEADLINE_SHARE:
                late[i] = answered
            else:
                ahead += cost
        return late

    def release(self, cost: int) -> None:
        self.queued -= cost

    def measured(self, cost: int, seconds: float) -> None:
        """Fold the time of finished work of ``cost`` units into the seconds-per-unit estimate."""
        if cost > 0:
            self.recent.append(seconds / cost)

    async def run(self, fn, *args):
        """``fn(*args)`` on the model thread; its result. Everything that runs the model goes through here, loading
        and warming up included: torch's parallel work (OpenMP) on a second thread that stays alive slows every
        batch of the model thread by about 20 % on a CPU (docs/serving.md)."""
        return await asyncio.wrap_future(self.pool.submit(fn, *args))

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
