"""FaultyProcessGroup on a fake group and the virtual clock: partition deadlines, ring delays."""

import asyncio
import random

import numpy as np
import pytest

from phalanx.collectives.faulty import FaultyProcessGroupFactory
from phalanx.core.errors import CollectiveError
from phalanx.sim.loop import run_virtual
from phalanx.transport.faulty import LinkEffect, NetworkConditions

MEMBERS = ("w0", "w1", "w2", "w3")


class FakeGroup:
    """Completes at once; records what reached it."""

    def __init__(self, quorum_id, rank, world_size):
        self.quorum_id, self.rank, self.world_size = quorum_id, rank, world_size
        self.calls: list[float] = []
        self.abandoned = False

    async def allreduce_sum(self, tensor, timeout_s):
        self.calls.append(asyncio.get_running_loop().time())

    def abandon(self):
        self.abandoned = True


class FakeFactory:
    def __init__(self):
        self.groups: list[FakeGroup] = []

    async def create(self, quorum_id, rank, world_size, timeout_s):
        self.groups.append(FakeGroup(quorum_id, rank, world_size))
        return self.groups[-1]


def setup(name="w0", members=MEMBERS):
    loop = asyncio.get_running_loop()
    cond = NetworkConditions(name, random.Random(0))
    inner = FakeFactory()
    factory = FaultyProcessGroupFactory(inner, cond, lambda q: members, loop.time, asyncio.sleep)
    return cond, inner, factory


async def _elapsed(coro):
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        await coro
        return loop.time() - t0, None
    except CollectiveError as e:
        return loop.time() - t0, e


def test_an_allreduce_across_a_partition_fails_at_its_deadline_without_calling_the_real_collective():
    async def main():
        cond, inner, factory = setup()
        pg = await factory.create(7, 0, 4, 5.0)
        cond.partition({"w3": 1})
        took, err = await _elapsed(pg.allreduce_sum(np.zeros(8, np.float32), 5.0))
        return took, err, inner.groups[0]

    (took, err, g), _ = run_virtual(main())
    assert isinstance(err, CollectiveError) and "partition" in str(err)
    assert took == pytest.approx(5.0) and g.calls == [] and g.abandoned


def test_an_allreduce_that_started_across_the_cut_still_fails_at_its_deadline_when_the_cut_heals_first():
    # The ranks never met: the real group is never entered, so no lone rank is left inside it.
    async def main():
        cond, inner, factory = setup()
        pg = await factory.create(7, 0, 4, 5.0)
        cond.partition({"w3": 1})
        asyncio.get_running_loop().call_later(2.0, cond.heal_partition)
        took, err = await _elapsed(pg.allreduce_sum(np.zeros(8, np.float32), 5.0))
        again, err2 = await _elapsed(factory.create(8, 0, 4, 5.0))
        return took, err, inner.groups[0], err2

    (took, err, g, err2), _ = run_virtual(main())
    assert isinstance(err, CollectiveError) and took == pytest.approx(5.0) and g.calls == [] and g.abandoned
    assert err2 is None  # healed: the next quorum's group forms


def test_a_partition_elsewhere_does_not_touch_a_group_on_one_side():
    async def main():
        cond, inner, factory = setup(members=("w0", "w1"))
        pg = await factory.create(7, 0, 2, 5.0)
        cond.partition({"w2": 1, "w3": 1})
        return await _elapsed(pg.allreduce_sum(np.zeros(8, np.float32), 5.0))

    (took, err), _ = run_virtual(main())
    assert err is None and took == 0.0


def test_a_group_cannot_form_on_the_minority_side_because_the_store_is_with_the_coordinator():
    async def main():
        cond, inner, factory = setup(name="w2", members=("w2", "w3"))
        cond.partition({"w2": 1, "w3": 1})
        took, err = await _elapsed(factory.create(9, 0, 2, 3.0))
        return took, err, inner.groups

    (took, err, groups), _ = run_virtual(main())
    assert isinstance(err, CollectiveError) and took == pytest.approx(3.0) and groups == []


def test_an_allreduce_is_slowed_by_the_ring_cost_of_latency_and_bandwidth():
    async def main():
        cond, inner, factory = setup()
        pg = await factory.create(7, 0, 4, 10.0)
        cond.set_effect("latency", LinkEffect(latency_s=0.01, distribution="constant"))
        cond.set_effect("bandwidth", LinkEffect(bandwidth_bytes_per_s=1e6))
        return await _elapsed(pg.allreduce_sum(np.zeros(250_000, np.float32), 10.0))  # 1 MB

    (took, err), _ = run_virtual(main())
    # 2(n-1) = 6 latencies + 2(n-1)/n x 1 MB / (1 MB/s)
    assert err is None and took == pytest.approx(6 * 0.01 + 1.5)


def test_an_allreduce_slowed_past_its_deadline_fails_at_the_deadline():
    async def main():
        cond, inner, factory = setup()
        pg = await factory.create(7, 0, 4, 2.0)
        cond.set_effect("bandwidth", LinkEffect(bandwidth_bytes_per_s=1e5))
        took, err = await _elapsed(pg.allreduce_sum(np.zeros(250_000, np.float32), 2.0))
        return took, err, inner.groups[0]

    (took, err, g), _ = run_virtual(main())
    assert isinstance(err, CollectiveError) and took == pytest.approx(2.0) and g.calls == [] and g.abandoned


def test_a_degraded_link_outside_the_group_does_not_slow_it():
    async def main():
        cond, inner, factory = setup(members=("w0", "w1"))
        pg = await factory.create(7, 0, 2, 5.0)
        cond.set_effect("latency", LinkEffect(latency_s=0.5, distribution="constant", peers=frozenset({"w3"})))
        return await _elapsed(pg.allreduce_sum(np.zeros(8, np.float32), 5.0))

    (took, err), _ = run_virtual(main())
    assert err is None and took == 0.0


def test_a_held_allreduce_cancelled_by_a_broken_quorum_abandons_the_group():
    async def main():
        cond, inner, factory = setup()
        pg = await factory.create(7, 0, 4, 5.0)
        cond.partition({"w1": 1})
        task = asyncio.ensure_future(pg.allreduce_sum(np.zeros(8, np.float32), 5.0))
        await asyncio.sleep(1.0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        with pytest.raises(CollectiveError, match="abandoned"):
            await pg.allreduce_sum(np.zeros(8, np.float32), 5.0)
        return inner.groups[0]

    g, _ = run_virtual(main())
    assert g.abandoned and g.calls == []


class StartableGroup(FakeGroup):
    """Records when and in which order started collectives reached it; each completes at once."""

    def __init__(self, quorum_id, rank, world_size):
        super().__init__(quorum_id, rank, world_size)
        self.started: list[tuple[float, int]] = []

    def start_allreduce_sum(self, tensor, share=1.0):
        self.started.append((asyncio.get_running_loop().time(), tensor.size))
        group = self

        class Done:
            async def wait(self, timeout_s):
                return None
        return Done() if not group.abandoned else None


class StartableFactory(FakeFactory):
    async def create(self, quorum_id, rank, world_size, timeout_s):
        self.groups.append(StartableGroup(quorum_id, rank, world_size))
        return self.groups[-1]


def _startable(members=MEMBERS):
    loop = asyncio.get_running_loop()
    cond = NetworkConditions("w0", random.Random(0))
    inner = StartableFactory()
    return cond, inner, FaultyProcessGroupFactory(inner, cond, lambda q: members, loop.time, asyncio.sleep)


def test_a_bucket_started_early_on_degraded_links_pays_its_delay_while_the_step_computes():
    # Overlap hides injected latency as it hides real latency: a bucket started at t=0 over links
    # that add 0.06 s is issued at 0.06 s, during a 0.5 s compute; waiting at 0.5 s costs nothing.
    async def main():
        cond, inner, factory = _startable()
        pg = await factory.create(7, 0, 4, 5.0)
        cond.set_effect("latency", LinkEffect(latency_s=0.01, distribution="constant"))
        pending = pg.start_allreduce_sum(np.zeros(8, np.float32))
        await asyncio.sleep(0.5)  # backward goes on
        took, err = await _elapsed(pending.wait(5.0))
        return took, err, inner.groups[0].started

    (took, err, started), _ = run_virtual(main())
    assert err is None and took == 0.0
    assert [t for t, _ in started] == [pytest.approx(6 * 0.01)]


def test_started_collectives_enter_the_group_in_the_order_they_were_started_whatever_their_delays():
    # The second bucket is small (a shorter delay) and the third starts after the links are clean:
    # both still wait for the first, or ranks would enter Gloo's collectives in different orders.
    async def main():
        cond, inner, factory = _startable()
        pg = await factory.create(7, 0, 4, 10.0)
        cond.set_effect("bandwidth", LinkEffect(bandwidth_bytes_per_s=1e6))
        big = pg.start_allreduce_sum(np.zeros(250_000, np.float32))  # 1 MB: 1.5 s
        small = pg.start_allreduce_sum(np.zeros(250, np.float32))  # 1 kB: 1.5 ms
        cond.clear_effect("bandwidth")
        clean = pg.start_allreduce_sum(np.zeros(25, np.float32))
        for p in (big, small, clean):
            await p.wait(10.0)
        after = pg.start_allreduce_sum(np.zeros(5, np.float32))  # nothing queued: straight in
        return inner.groups[0].started, after

    (started, after), _ = run_virtual(main())
    assert [n for _, n in started] == [250_000, 250, 25, 5]
    assert [t for t, _ in started][:3] == [pytest.approx(1.5), pytest.approx(1.5015), pytest.approx(1.5015)]
    assert after is not None


def test_a_started_collective_past_its_deadline_fails_and_abandons_the_group():
    async def main():
        cond, inner, factory = _startable()
        pg = await factory.create(7, 0, 4, 2.0)
        cond.set_effect("bandwidth", LinkEffect(bandwidth_bytes_per_s=1e5))
        pending = pg.start_allreduce_sum(np.zeros(250_000, np.float32))  # 15 s of delay
        took, err = await _elapsed(pending.wait(2.0))
        await asyncio.sleep(20.0)  # the delayed issue never reaches the abandoned group
        return took, err, inner.groups[0]

    (took, err, g), _ = run_virtual(main())
    assert isinstance(err, CollectiveError) and took == pytest.approx(2.0) and g.abandoned and g.started == []
