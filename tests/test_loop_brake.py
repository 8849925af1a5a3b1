"""The loop brake on its own: a loop held busy cuts the samples in flight, an idle one gets them back.

The busy loop is made by blocking it (0.5 s at a time against a 0.2 s limit), so the lateness is
the test's own and holds on any machine; waits end on the condition, with long deadlines.
"""

import asyncio
import time

from eagle3_assets.generation.loop_brake import LoopBrake


def test_a_late_loop_cuts_the_gate_and_an_idle_one_restores_it():
    async def main():
        brake = LoopBrake(100, max_lag_s=0.2)
        brake.rtt_s = 0.2  # one decision per 0.2 s
        probe = asyncio.create_task(brake.run())
        for _ in range(100):
            await brake.acquire()
        for _ in range(4):  # the loop busy: the probe wakes 0.5 s late
            time.sleep(0.5)
            await asyncio.sleep(0.02)
        cut = brake.limit
        assert cut < 100
        blocked = asyncio.create_task(brake.acquire())  # the limit is reached: a new sample waits
        await asyncio.sleep(0.05)
        assert not blocked.done()
        for _ in range(100):
            brake.release()
        await asyncio.wait_for(blocked, 60)
        brake.release()
        deadline = time.monotonic() + 120
        while brake.limit < 100 and time.monotonic() < deadline:  # on time again: back to the gate
            await asyncio.sleep(0.05)
        probe.cancel()
        return cut, brake.limit, brake.figures()

    cut, limit, figures = asyncio.run(main())
    assert limit == 100 and figures["in_flight_limit_min"] <= int(cut)
    assert figures["loop_lag_ms_max"] >= 500 and 0 < figures["in_flight_limited_share"] < 1


def test_no_limit_means_the_gate_stays_whole():
    async def main():
        brake = LoopBrake(10, max_lag_s=None)
        probe = asyncio.create_task(brake.run())
        for _ in range(10):
            await brake.acquire()
        time.sleep(0.3)
        await asyncio.sleep(0.05)
        probe.cancel()
        return brake

    brake = asyncio.run(main())
    assert brake.limit == 10 and brake.figures()["in_flight_limited_share"] == 0
