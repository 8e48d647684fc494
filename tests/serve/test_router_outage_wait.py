"""No replica in rotation: a request waits for one while the outage is young (a blip: every replica missed its
polls at once on a starved box) instead of getting a 503, and a long outage answers 503 at once. The router on
hand-set membership state: no processes, no sockets; waits are bounded by generous deadlines, nothing is timed."""

from __future__ import annotations

import asyncio
import time

import pytest

from phalanx.serve.router import NoHealthyReplica, Router, RouterConfig
from phalanx.serve.routing_policy import may_wait_for_replica

WAIT_S = 60.0  # longer than any test: what the router decides cannot depend on how loaded the box is


def _router(wait_s: float = WAIT_S) -> Router:
    return Router({"r0": "http://127.0.0.1:9", "r1": "http://127.0.0.1:9"}, RouterConfig(outage_wait_s=wait_s))


@pytest.mark.parametrize("age_s, waits", [(0.0, True), (1.99, True), (2.0, False), (30.0, False)])
def test_a_request_waits_for_a_replica_only_while_the_outage_is_younger_than_the_wait(age_s, waits):
    ok, why = may_wait_for_replica(100.0 + age_s, 100.0, 2.0)
    assert ok is waits and ("wait" in why if waits else "503" in why)


def test_membership_notes_when_the_last_replica_left_rotation_and_forgets_it_when_one_returns():
    router = _router()
    now_s = time.monotonic()
    router._decide_membership(now_s)  # nobody has answered a poll: no replica in rotation
    assert router.no_replica_since_s == now_s
    router._decide_membership(now_s + 0.1)
    assert router.no_replica_since_s == now_s  # the outage's start, not the last tick
    r1 = router.replicas["r1"]
    r1.connected, r1.good_polls, r1.last_heartbeat_s = True, 1, now_s + 0.2
    router._decide_membership(now_s + 0.2)
    assert r1.stats.healthy and router.no_replica_since_s is None


def test_a_request_arriving_in_a_young_outage_waits_and_goes_to_the_first_replica_back():
    async def go() -> None:
        router = _router()
        router.no_replica_since_s = time.monotonic()
        task = asyncio.ensure_future(router.choose_waiting(frozenset()))
        for _ in range(5):  # it is waiting, not refused
            await asyncio.sleep(0.02)
        assert not task.done()
        router.replicas["r1"].stats.healthy = True  # r1 re-admitted
        r = await asyncio.wait_for(task, 30.0)
        assert r.stats.replica_id == "r1"
        assert router.metrics.outage_waits._value.get() == 1
        await router.client.aclose()

    asyncio.run(go())


def test_a_request_arriving_in_an_old_outage_gets_its_503_at_once():
    async def go() -> None:
        router = _router()
        router.no_replica_since_s = time.monotonic() - WAIT_S - 1
        with pytest.raises(NoHealthyReplica):
            await asyncio.wait_for(router.choose_waiting(frozenset()), 30.0)
        status, payload, _ = await asyncio.wait_for(router.unary("/v1/completions", {"model": "m", "prompt": "x"}),
                                                    30.0)
        assert status == 503 and payload["error"]["code"] == "replicas_unavailable"
        assert router.metrics.outage_waits._value.get() == 0
        await router.client.aclose()

    asyncio.run(go())


def test_the_wait_ends_with_a_503_when_no_replica_returns_in_time():
    async def go() -> None:
        router = _router(wait_s=0.2)  # the outage starts when the request first finds none
        with pytest.raises(NoHealthyReplica):
            await asyncio.wait_for(router.choose_waiting(frozenset()), 30.0)
        assert router.no_replica_since_s is not None and router.metrics.outage_waits._value.get() == 1
        await router.client.aclose()

    asyncio.run(go())
