"""The coordinator's ticker runs when something can be due, not every tick_s: few wakeups while
workers compute, and every detection and formation wait still on time (the simulated host, with
hand-driven workers as in test_coordinator)."""

import asyncio

from phalanx.core.alarm import Alarm
from phalanx.core.modes import ConsistencyMode, ModeConfig
from phalanx.core.messages import AllreduceDone, Bundle, Heartbeat, Progress, QuorumAssigned, QuorumRequest
from phalanx.membership.quorum import QuorumConfig
from phalanx.sim.loop import run_virtual
from tests.membership.test_coordinator import _next, _run

TIMEOUT_S, PROGRESS_S = 0.6, 2.0  # DetectorConfig's defaults


def _count_ticks(coord):
    ticks = []
    evaluate = coord._evaluate

    def counted(from_tick=False):
        if from_tick:
            ticks.append(asyncio.get_running_loop().time())
        evaluate(from_tick)

    coord._evaluate = counted
    return ticks


def _beat(conn, until_s, every_s=0.1):
    async def beat():
        seq = 0
        while asyncio.get_running_loop().time() < until_s:
            seq += 1
            await conn.send(Heartbeat(seq=seq, step=-1))
            await asyncio.sleep(every_s)

    return asyncio.get_running_loop().create_task(beat())


def _suspected_at(coord, worker):
    return [coord._t0 + e["t"] for e in coord.events if e["event"] == "worker_suspected" and e["worker"] == worker]


async def _two_in_a_quorum(connect):
    a, _ = await connect("w0")
    b, _ = await connect("w1")
    for c in (a, b):
        await c.send(QuorumRequest(step=0, last_committed_step=-1, has_state=False))
    q = await _next(a, QuorumAssigned)
    await _next(b, QuorumAssigned)
    return a, b, q


def test_the_ticker_wakes_a_few_times_a_second_while_workers_compute():
    async def scenario(coord, connect, loop):
        a, b, _ = await _two_in_a_quorum(connect)
        ticks = _count_ticks(coord)
        t0 = loop.time()
        beats = [_beat(c, t0 + 1.9) for c in (a, b)]  # a long step: no reports, heartbeats only
        await asyncio.sleep(1.9)
        await asyncio.gather(*beats)
        return ticks, t0, coord.quorum.decided, [w for w in ("w0", "w1") if _suspected_at(coord, w)]

    ticks, t0, decided, suspected = _run(scenario, quorum=QuorumConfig(expected_workers=2))
    assert not decided and suspected == []
    # the heartbeat watch is due ~0.5 s after each tick (the quietest worker, heard <= 0.1 s ago);
    # the 20 ms ticker it replaces woke 95 times in these 1.9 s
    assert 1 <= len(ticks) <= 6, f"{len(ticks)} ticks in 1.9 s: {[round(t - t0, 3) for t in ticks]}"


def test_a_silent_worker_is_suspected_as_its_heartbeat_timeout_runs_out():
    async def scenario(coord, connect, loop):
        a, b, _ = await _two_in_a_quorum(connect)
        t0 = loop.time()
        beat = _beat(a, t0 + 2.0)
        silent_from = loop.time()  # w1 says nothing more (frozen)
        await b.send(Heartbeat(seq=1, step=-1))
        await asyncio.sleep(1.5)
        await beat
        return silent_from, _suspected_at(coord, "w1"), _suspected_at(coord, "w0")

    silent_from, w1_at, w0_at = _run(scenario, quorum=QuorumConfig(expected_workers=2))
    assert w0_at == [] and len(w1_at) == 1
    late_s = w1_at[0] - silent_from - TIMEOUT_S
    assert 0 < late_s < 0.01, f"suspected {late_s * 1e3:.1f} ms after its timeout ran out"


def test_a_formation_waiting_on_a_timeout_is_retried_on_time_after_a_long_sleep():
    async def scenario(coord, connect, loop):
        a, _ = await connect("w0")
        b, _ = await connect("w1")
        beats = [_beat(c, loop.time() + 2.5) for c in (a, b)]
        await asyncio.sleep(1.0)  # nothing waits: the ticker sleeps on the heartbeat watch
        asked = loop.time()
        await a.send(QuorumRequest(step=0, last_committed_step=-1, has_state=False))  # w1 never asks
        got = await _next(a, QuorumAssigned)
        formed = loop.time()
        await asyncio.gather(*beats)
        return formed - asked, got.members

    waited_s, members = _run(scenario, quorum=QuorumConfig(expected_workers=1, join_timeout_s=0.5))
    assert members == ["w0"]
    assert 0.5 <= waited_s < 0.5 + 0.02 + 0.005, f"formed {waited_s:.3f} s after the request"


def test_the_progress_watch_fires_on_time_for_a_member_left_behind():
    async def scenario(coord, connect, loop):
        a, b, q = await _two_in_a_quorum(connect)
        beats = [_beat(c, loop.time() + 3.0) for c in (a, b)]
        await asyncio.sleep(0.3)
        reported = loop.time()
        await a.send(AllreduceDone(step=0, quorum_id=q.quorum_id, ok=True, samples_covered_once=True))
        await asyncio.gather(*beats)  # w1 heartbeats but never reports
        return reported, _suspected_at(coord, "w1")

    reported, w1_at = _run(scenario, quorum=QuorumConfig(expected_workers=2))
    assert len(w1_at) == 1
    late_s = w1_at[0] - reported - PROGRESS_S
    assert 0 < late_s < 0.01, f"suspected {late_s * 1e3:.1f} ms after the progress timeout ran out"


def test_a_backdated_progress_mark_brings_the_progress_watch_forward():
    async def scenario(coord, connect, loop):
        a, b, q = await _two_in_a_quorum(connect)
        formed = loop.time()
        beats = [_beat(c, formed + 3.0) for c in (a, b)]
        await asyncio.sleep(2.01)  # just after a tick, which saw nobody behind
        # w0 has been in its all-reduce for 1.96 s: the others are behind since formed + 0.05, so
        # the watch is due in 40 ms, long before the heartbeat watch wakes the ticker again
        await a.send(Progress(step=0, quorum_id=q.quorum_id, phase="allreduce", age_s=1.96))
        await asyncio.gather(*beats)
        return formed, _suspected_at(coord, "w1")

    formed, w1_at = _run(scenario, quorum=QuorumConfig(expected_workers=2))
    assert len(w1_at) == 1
    late_s = w1_at[0] - (formed + 0.05) - PROGRESS_S
    assert 0 < late_s < 0.01, f"suspected {late_s * 1e3:.1f} ms after the backdated timeout ran out"


def test_available_mode_s_shorter_progress_watch_takes_effect_from_the_commit_that_shortens_it():
    async def scenario(coord, connect, loop):
        a, b, q = await _two_in_a_quorum(connect)
        beats = [_beat(c, loop.time() + 2.5) for c in (a, b)]
        for step in range(3):  # the second commit times a step: the watch drops from 2 s to 0.25 s
            await asyncio.sleep(0.05)
            for c in (a, b):
                await c.send(AllreduceDone(step=step, quorum_id=q.quorum_id, ok=True, samples_covered_once=True,
                                           next_step=step + 1))
            for c in (a, b):
                await _next(c, Bundle)  # the decision and the next step's grant
        assert coord.cfg.detector.progress_timeout_s == 0.25
        reported = loop.time()
        await a.send(AllreduceDone(step=3, quorum_id=q.quorum_id, ok=True, samples_covered_once=True))
        await asyncio.gather(*beats)  # w1 heartbeats but never reports
        return reported, _suspected_at(coord, "w1")

    reported, w1_at = _run(scenario, quorum=QuorumConfig(expected_workers=2),
                           modes=ModeConfig(mode=ConsistencyMode.AVAILABLE))
    assert len(w1_at) == 1
    late_s = w1_at[0] - reported - 0.25
    assert 0 < late_s < 0.01, f"suspected {late_s * 1e3:.1f} ms after the available deadline ran out"


def test_the_alarm_runs_at_its_due_time_at_the_earliest_ring_and_waits_when_cleared():
    class Host:
        def now(self):
            return asyncio.get_running_loop().time()

        async def sleep(self, s):
            await asyncio.sleep(s)

    async def main():
        loop = asyncio.get_running_loop()
        alarm = Alarm(Host())
        woke = []

        async def sleeper():
            for _ in range(3):
                due = await alarm.wait()
                woke.append((round(loop.time(), 6), due))
                alarm.clear()

        task = loop.create_task(sleeper())
        alarm.ring_by(1.0)
        await asyncio.sleep(0.1)
        alarm.ring_by(0.3)  # brought forward
        alarm.ring_by(0.8)  # a later time keeps the earlier one
        await asyncio.sleep(0.5)  # woke at 0.3 and cleared: it waits for a ring
        alarm.ring_by(loop.time() + 0.2)
        await asyncio.sleep(0.5)
        alarm.ring_by(-1.0)  # a time already past runs it at once
        await task
        return woke

    woke = run_virtual(main(), 1)[0]
    assert woke == [(0.3, 0.3), (0.8, 0.8), (1.1, -1.0)]


def test_a_coordinator_frozen_past_its_due_time_blames_no_worker_whose_messages_wait_unread():
    async def scenario(coord, connect, loop):
        a, b, _ = await _two_in_a_quorum(connect)
        beats = [_beat(c, loop.time() + 4.0) for c in (a, b)]
        await asyncio.sleep(0.7)
        ticks = _count_ticks(coord)
        await asyncio.sleep(0.05)
        while not ticks:  # freeze it just after a tick, which looked up to a heartbeat timeout ahead
            await asyncio.sleep(0.001)
        coord.host.node.frozen_until_s = loop.time() + 1.5  # SIGSTOP: it reads nothing, wakes for nothing
        await asyncio.gather(*beats)
        return [e for e in coord.events if e["event"] in ("worker_suspected", "step_aborted", "coordinator_late")]

    for seed in range(6):  # timers due at one instant run in a seeded order: the thaw's too
        events = _run(scenario, _seed=seed, quorum=QuorumConfig(expected_workers=2))
        assert [e["event"] for e in events] == ["coordinator_late"], (seed, events)
        assert 1.5 - TIMEOUT_S - 0.1 < events[0]["late_s"] <= 1.5, (seed, events)
