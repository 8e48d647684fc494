import asyncio

import pytest

from phalanx.sim.loop import SimDeadlock, run_virtual


def test_virtual_time_jumps_to_the_next_timer_without_waiting():
    async def main():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.sleep(3600)  # an hour of virtual time
        return loop.time() - t0

    import time
    wall = time.perf_counter()
    elapsed, loop = run_virtual(main())
    assert elapsed == pytest.approx(3600) and time.perf_counter() - wall < 1.0


def _order(seed: int) -> list[int]:
    out: list[int] = []

    async def main():
        loop = asyncio.get_running_loop()
        for i in range(20):
            loop.call_later(1.0, out.append, i)  # all due at the same instant
        await asyncio.sleep(2)

    run_virtual(main(), seed)
    return out


def test_same_instant_timers_run_in_a_seeded_order():
    assert _order(1) == _order(1)
    assert sorted(_order(1)) == list(range(20))
    assert _order(1) != _order(2)


def test_a_deadlock_is_reported_not_hung():
    async def main():
        await asyncio.get_running_loop().create_future()

    with pytest.raises(SimDeadlock):
        run_virtual(main())
