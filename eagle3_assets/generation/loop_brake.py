"""Fewer samples in flight while the client's event loop runs late, so replies are read and written
as they arrive.

A reply the provider delivered is paid for, and it is at risk until its row is in the file: a kill
loses every reply still waiting in a socket buffer for a loop too busy to read it. When one process
gets more replies per second than it can parse and write (short replies at a large gate, a slow or
busy machine), requests beyond what it can handle do not raise its throughput; they only lengthen
that queue of paid, unwritten replies. So the engine times a short sleep: while the loop wakes it
more than ``max_lag_s`` late (the median over about one round trip), the number of samples it keeps
in flight is cut (x0.8); once the loop is on time again it grows back (+10% of the gate per round
trip). At the motivating job's pace (2,000 replies of ~165 s: ~12 per second) the loop is idle and
the limit stays at the gate.
"""

from __future__ import annotations

import asyncio
import statistics
import time

PROBE_S = 0.01
DECREASE, INCREASE = 0.8, 0.1
RESERVOIR = 20_000  # lag samples kept for the percentiles (every sample counts in the mean and max)


class LoopBrake:
    def __init__(self, gate: int, max_lag_s: float | None):
        self.gate, self.max_lag = gate, max_lag_s
        self.limit = float(gate)
        self.floor = max(1, gate // 50)
        self.active = 0
        self.min_limit = gate
        self.limited_s = 0.0  # time with the limit below the gate
        self.rtt_s = 0.5  # recent round trip of a request (EWMA), the period of a decision
        self._changed = asyncio.Event()
        self._closed = False
        self._lags: list[float] = []
        self._n = 0
        self._sum = self._max = 0.0
        self._t0 = time.monotonic()

    # -- the slots -------------------------------------------------------------------------------
    async def acquire(self) -> None:
        """A place for one sample; waits while the limit is reached (never once closed)."""
        while not self._closed and self.active >= max(1, int(self.limit)):
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), 0.1)
            except TimeoutError:
                pass
        self.active += 1

    def release(self) -> None:
        self.active -= 1
        self._changed.set()

    def close(self) -> None:
        """The run is stopping: nobody waits at the brake any more."""
        self._closed = True
        self._changed.set()

    def observe_rtt(self, seconds: float) -> None:
        self.rtt_s += 0.05 * (seconds - self.rtt_s)

    # -- the probe -------------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        window: list[float] = []
        decided = loop.time()
        while True:
            t = loop.time()
            await asyncio.sleep(PROBE_S)
            now = loop.time()
            lag = max(0.0, now - t - PROBE_S)
            self._record(lag)
            window.append(lag)
            if self.limit < self.gate:
                self.limited_s += now - t
            if self.max_lag is None or now - decided < min(10.0, max(0.2, self.rtt_s)):
                continue
            med = statistics.median(window)
            window.clear()
            decided = now
            if med > self.max_lag:
                self.limit = max(self.floor, min(self.limit, self.active) * DECREASE)
                self.min_limit = min(self.min_limit, int(self.limit))
            elif med < self.max_lag / 4 and self.limit < self.gate:
                self.limit = min(self.gate, self.limit + INCREASE * self.gate)
                self._changed.set()

    def _record(self, lag: float) -> None:
        self._n += 1
        self._sum += lag
        self._max = max(self._max, lag)
        if len(self._lags) < RESERVOIR:
            self._lags.append(lag)
        else:
            self._lags[self._n % RESERVOIR] = lag

    def figures(self) -> dict:
        """The loop's lateness (ms) and how long, and how far, the brake held the gate below its size."""
        lags = sorted(self._lags)

        def q(p: float) -> float:
            return round(1000 * lags[min(len(lags) - 1, int(p * len(lags)))], 1) if lags else 0.0

        span = time.monotonic() - self._t0
        return {"loop_lag_ms_mean": round(1000 * self._sum / self._n, 1) if self._n else 0.0,
                "loop_lag_ms_p50": q(0.5), "loop_lag_ms_p99": q(0.99), "loop_lag_ms_max": round(1000 * self._max, 1),
                "in_flight_limit_min": self.min_limit,
                "in_flight_limited_share": round(self.limited_s / span, 4) if span > 0 else 0.0}
