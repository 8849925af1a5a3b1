"""The in-flight gate's bookkeeping for the run loop (``http_run.py``): the workers waiting for
budget room, and the gate's occupancy over time that the report and the budget policies read."""

from __future__ import annotations

import asyncio
import time
from collections import deque

FULL_GATE = 0.95  # "the gate is full": at least this share of it in flight


class Waiters:
    """Workers waiting for budget room: a settled reply wakes one, a closing lane wakes all."""

    def __init__(self):
        self._futures: deque[asyncio.Future] = deque()

    async def wait(self, timeout: float) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._futures.append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            pass
        finally:
            if not fut.done():
                fut.cancel()

    def wake(self, n: int = 1) -> None:
        while n and self._futures:
            fut = self._futures.popleft()
            if not fut.done():
                fut.set_result(None)
                n -= 1

    def wake_all(self) -> None:
        self.wake(len(self._futures))


class GateMeter:
    """The gate over time, while samples were still waiting to be admitted: requests in flight on
    the wire (peak, time-weighted mean) and samples holding a place in the gate (admitted and not
    finished: in flight, being written, or backing off before a retry), whose share of time at 95%
    or more of the gate is what a budget policy may not take away."""

    def __init__(self, gate: int):
        self.gate = gate
        self.now = self.peak = self.held = 0
        self.t0 = self._t = time.monotonic()
        self.area = self.full = 0.0
        self.closed_at: float | None = None

    def _tick(self) -> None:
        t = time.monotonic()
        if self.closed_at is None:
            dt = t - self._t
            self.area += self.now * dt
            if self.held >= FULL_GATE * self.gate:
                self.full += dt
        self._t = t

    def add(self, delta: int) -> None:
        self._tick()
        self.now += delta
        self.peak = max(self.peak, self.now)

    def hold(self, delta: int) -> None:
        self._tick()
        self.held += delta

    def close(self) -> None:
        if self.closed_at is None:
            self._tick()
            self.closed_at = time.monotonic()

    def figures(self) -> tuple[float, float]:
        end = self.closed_at
        if end is None:
            self._tick()
            end = time.monotonic()
        span = end - self.t0
        return (self.area / span, self.full / span) if span > 0 else (0.0, 0.0)
