"""How late the client's event loop runs: the measure of how long a delivered reply can wait unread.

A reply the provider delivered is paid for, and it is at risk until its row is in the file: a kill
loses every reply still waiting in a socket buffer for a loop busy with others. The engine times a
short sleep all run long; how late it wakes is how long the loop makes ready work wait. At the
motivating job's pace (2,000 replies of ~165 s: ~12 per second) it is a millisecond or two; when one
process gets more replies per second than it can parse and write (short replies at a large gate, a
slow or busy machine) it grows, and the run's metadata says so.
"""

from __future__ import annotations

import asyncio

PROBE_S = 0.01
RESERVOIR = 20_000  # samples kept for the percentiles (every sample counts in the mean and max)


class LoopLag:
    def __init__(self):
        self._lags: list[float] = []
        self._n = 0
        self._sum = self._max = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(PROBE_S)
            self._record(max(0.0, loop.time() - t - PROBE_S))

    def _record(self, lag: float) -> None:
        self._n += 1
        self._sum += lag
        self._max = max(self._max, lag)
        if len(self._lags) < RESERVOIR:
            self._lags.append(lag)
        else:
            self._lags[self._n % RESERVOIR] = lag

    def figures(self) -> dict:
        """Lateness in milliseconds: mean, median, 99th percentile, worst."""
        lags = sorted(self._lags)

        def q(p: float) -> float:
            return round(1000 * lags[min(len(lags) - 1, int(p * len(lags)))], 1) if lags else 0.0

        return {"loop_lag_ms_mean": round(1000 * self._sum / self._n, 1) if self._n else 0.0,
                "loop_lag_ms_p50": q(0.5), "loop_lag_ms_p99": q(0.99), "loop_lag_ms_max": round(1000 * self._max, 1)}
