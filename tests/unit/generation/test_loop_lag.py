"""The client's loop-lateness figure: a loop held busy shows it, whatever the machine's speed."""

import asyncio
import time

from eagle3_assets.generation.loop_lag import LoopLag


def test_a_busy_loop_shows_in_the_lateness_figures():
    async def main():
        lag = LoopLag()
        probe = asyncio.create_task(lag.run())
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # the loop busy for 0.3 s: the probe wakes at least that late once
        await asyncio.sleep(0.05)
        probe.cancel()
        return lag.figures()

    figures = asyncio.run(main())
    assert figures["loop_lag_ms_max"] >= 250 > figures["loop_lag_ms_p50"]  # the probe slept up to 10 ms of it
