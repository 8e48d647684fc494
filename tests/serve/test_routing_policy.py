"""Routing decisions, table-tested with a seeded rng and explicit time (no clock, no sockets)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from phalanx.core.errors import ConfigError
from phalanx.serve.cluster import router_config
from phalanx.serve.routing_policy import (HedgeRule, HeldRequest, Policy, PolicyConfig, ReplicaStats, RollingLatency,
                                          after_failure, choose_replica, hedge_delay_s, hedge_target, held_to_move,
                                          latency_outliers, may_hedge, may_retry)


def fleet(*specs: tuple[str, int, float]) -> list[ReplicaStats]:
    out = []
    for rid, outstanding, ewma in specs:
        r = ReplicaStats(rid, healthy=True, outstanding=outstanding)
        if ewma:
            r.ewma_latency_s, r.samples = ewma, 20
        out.append(r)
    return out


def test_p2c_latency_avoids_the_slow_replica_that_p2c_queue_keeps_feeding():
    # r3 is 10x slow but has fewer outstanding requests: queue-length P2C prefers it, latency-weighted does not
    reps = fleet(("r0", 2, 0.1), ("r1", 2, 0.1), ("r2", 2, 0.1), ("r3", 1, 1.0))
    cfg_q, cfg_l = PolicyConfig(policy=Policy.P2C_QUEUE), PolicyConfig(policy=Policy.P2C_LATENCY)
    rng_q, rng_l = random.Random(1), random.Random(1)
    picks_q = [choose_replica(0.0, reps, cfg_q, rng_q, 0)[0].replica_id for _ in range(200)]
    picks_l = [choose_replica(0.0, reps, cfg_l, rng_l, 0)[0].replica_id for _ in range(200)]
    assert picks_q.count("r3") > 80 and picks_l.count("r3") == 0


@pytest.mark.parametrize("healthy,ejected_until,exclude,expect", [
    ([True, True], [0, 0], frozenset({"r0"}), "r1"),
    ([False, True], [0, 0], frozenset(), "r1"),
    ([True, True], [5.0, 0], frozenset(), "r1"),  # r0 ejected until t=5
    ([True, False], [0, 0], frozenset({"r0"}), None),
    ([True, False], [5.0, 0], frozenset(), "r0"),  # the only healthy one is ejected: it still serves (panic routing)
    ([True, True], [5.0, 5.0], frozenset({"r0"}), "r1"),  # all ejected: the one not yet tried
    ([False, False], [0, 0], frozenset(), None),
])
def test_choice_skips_unhealthy_ejected_and_excluded(healthy, ejected_until, exclude, expect):
    reps = fleet(("r0", 0, 0.1), ("r1", 0, 0.1))
    for r, h, e in zip(reps, healthy, ejected_until):
        r.healthy, r.ejected_until_s = h, e
    picked, reason = choose_replica(1.0, reps, PolicyConfig(), random.Random(0), 0, exclude)
    assert (picked.replica_id if picked else None) == expect and reason


def test_round_robin_cycles_in_id_order():
    reps = fleet(("r1", 0, 0), ("r0", 0, 0), ("r2", 0, 0))
    cfg = PolicyConfig(policy=Policy.ROUND_ROBIN)
    assert [choose_replica(0, reps, cfg, random.Random(0), i)[0].replica_id for i in range(4)] == ["r0", "r1", "r2", "r0"]


@pytest.mark.parametrize("active,in_flight,attempt,ok", [
    (10, 0, 1, True), (10, 3, 1, False), (100, 19, 1, True), (100, 20, 1, False), (100, 0, 3, False)])
def test_retry_budget_is_a_fraction_of_active_requests_with_a_floor(active, in_flight, attempt, ok):
    assert may_retry(active, in_flight, attempt, PolicyConfig())[0] is ok


def test_hedging_waits_for_samples_then_fires_at_p95_under_budget():
    h, cfg = RollingLatency(), PolicyConfig()
    assert hedge_delay_s(h, cfg) is None
    for i in range(100):
        h.add(0.01 * (i + 1))
    assert hedge_delay_s(h, cfg) == pytest.approx(0.96)
    assert may_hedge(100, 9, cfg)[0] and not may_hedge(100, 10, cfg)[0]


def test_consecutive_failures_eject_and_latency_outlier_is_found():
    r = ReplicaStats("r0", healthy=True)
    cfg = PolicyConfig()
    assert [after_failure(1.0, r, cfg)[0] for _ in range(5)] == [False] * 4 + [True]
    assert r.ejected_until_s == 3.0
    reps = fleet(("a", 0, 0.1), ("b", 0, 0.12), ("c", 0, 0.09), ("d", 0, 1.0))
    assert [x.replica_id for x, _ in latency_outliers(0, reps, cfg)] == ["d"]
    assert latency_outliers(0, fleet(("a", 0, 0.1), ("b", 0, 0.12), ("c", 0, 0.2)), cfg) == []
    assert latency_outliers(0, reps, dataclasses.replace(cfg, outlier_latency_ratio=0.0)) == []  # 0: off


def test_router_config_takes_an_outlier_ratio_and_refuses_a_negative_or_nan_one():
    assert router_config("round-robin", False, outlier_ratio=0.0).policy.outlier_latency_ratio == 0.0
    assert router_config("round-robin", False).policy.outlier_latency_ratio == PolicyConfig().outlier_latency_ratio
    for bad in (-1.0, float("nan")):
        with pytest.raises(ConfigError, match="--outlier-ratio"):
            router_config("p2c-latency", False, outlier_ratio=bad)


def test_a_request_whose_replica_died_is_retried_outside_the_budget_but_within_attempts_max():
    cfg = PolicyConfig()
    assert may_retry(10, 50, 1, cfg)[0] is False  # overload-shaped failure: the budget holds
    assert may_retry(10, 50, 1, cfg, replica_gone=True)[0] is True  # moving a dead replica's request adds no load
    assert may_retry(10, 0, 3, cfg, attempts_max=3, replica_gone=True)[0] is False


def test_a_request_in_flight_longer_than_the_ewma_makes_its_replica_look_slow_at_once():
    fast = ReplicaStats("a", healthy=True, outstanding=2, ewma_latency_s=0.1, samples=50)
    fresh = ReplicaStats("b", healthy=True, outstanding=1, samples=0, inflight_since_s=[0.0])  # never answered yet
    cfg = PolicyConfig(policy=Policy.P2C_LATENCY)
    assert choose_replica(0.05, [fast, fresh], cfg, random.Random(0), 0)[0] is fresh  # young request: not yet suspect
    assert choose_replica(1.0, [fast, fresh], cfg, random.Random(0), 0)[0] is fast  # 1 s in flight vs 0.1 s typical


def test_the_ewma_keeps_the_time_per_request_so_a_queue_is_counted_once():
    r = ReplicaStats("r0", healthy=True)
    r.observe(1.0, 0.3, ahead=3)  # waited behind 3 others: 0.25 s per request
    assert r.ewma_latency_s == pytest.approx(0.25)
    r.observe(0.25, 0.3)
    assert r.ewma_latency_s == pytest.approx(0.25)


def hedge_fleet() -> list[ReplicaStats]:
    # r3 is 10x slow (5 s a request); r0 idle, r1 and r2 with queues of 2 (0.5 s a request each)
    return fleet(("r0", 0, 0.5), ("r1", 2, 0.5), ("r2", 2, 0.5), ("r3", 1, 5.0))


def test_a_hedge_moves_a_request_stuck_behind_a_slow_replica_to_one_with_room():
    reps = hedge_fleet()
    target, why = hedge_target(0.0, reps, reps[3], 0, 1.0, PolicyConfig())
    assert target is reps[0], why  # 0.5 s expected on r0 < 4 s still owed on r3


def test_no_hedge_into_queues_that_would_answer_after_the_primary():
    reps = hedge_fleet()
    reps[0].outstanding = 2  # every fast replica now has a queue: 1.5 s expected
    target, why = hedge_target(0.0, reps, reps[1], 1, 0.7, PolicyConfig())  # r1 owes 2 x 0.5 - 0.7 = 0.3 s
    assert target is None and "no hedge" in why
    old = PolicyConfig(hedge_rule=HedgeRule.ANY_AFTER_P95)  # the earlier rule hedged anyway, adding load
    assert hedge_target(0.0, reps, reps[1], 1, 0.7, old)[0] is not None


def test_an_overdue_request_is_assumed_to_need_as_long_again():
    reps = hedge_fleet()
    # on r1 with nothing ahead, expected 0.5 s, already 2 s in flight: r0 (0.5 s) beats the 2 s it may still need
    assert hedge_target(0.0, reps, reps[1], 0, 2.0, PolicyConfig())[0] is reps[0]


def test_a_hedge_respects_exclusions_and_never_targets_the_primary():
    reps = hedge_fleet()
    assert hedge_target(0.0, reps, reps[3], 0, 1.0, PolicyConfig(), frozenset({"r0", "r1", "r2"}))[0] is None
    for r in reps[:3]:
        r.healthy = False
    assert hedge_target(0.0, reps, reps[3], 0, 1.0, PolicyConfig())[0] is None


def test_p2c_latency_with_more_choices_draws_that_many_and_keeps_the_cheapest():
    reps = fleet(("r0", 3, 0.1), ("r1", 0, 0.1), ("r2", 3, 0.1), ("r3", 3, 0.1))
    cfg = PolicyConfig(p2c_choices=4)
    assert {choose_replica(0.0, reps, cfg, random.Random(s), 0)[0].replica_id for s in range(20)} == {"r1"}


def ejected_fleet(now: float = 10.0) -> list[ReplicaStats]:
    """r3 (5 s a request) was just ejected holding 4 requests (the oldest running for 4.5 s); r0-r2 take 0.5 s,
    r0 idle, r1 and r2 with 2 each."""
    reps = fleet(("r0", 0, 0.5), ("r1", 2, 0.5), ("r2", 2, 0.5), ("r3", 4, 5.0))
    reps[3].ejected_until_s = now + 2.0
    return reps


HELD = [HeldRequest(1, 5.5), HeldRequest(2, 7.0), HeldRequest(3, 8.0), HeldRequest(4, 9.5)]


def test_an_ejected_replica_moves_the_requests_queued_behind_it_where_they_finish_sooner():
    reps = ejected_fleet()
    moves = held_to_move(10.0, reps[3], HELD, reps, PolicyConfig(), active=12)
    # from the back: #4 owes 4 x 5 - 0.5 = 19.5 s, #3 13 s, #2 7 s; r0 takes them at 0.5, 1.0, 1.5 s, then
    # r1/r2 (1.5 s each); #1 is running and owes 0.5 s: cheaper to let it finish than to start again anywhere
    assert [k for k, _ in moves] == [4, 3, 2], moves
    assert all("r3" in why for _, why in moves)


@pytest.mark.parametrize("cfg, held, active, expect", [
    (PolicyConfig(ejection_moves=False), HELD, 12, []),  # the switch (the benchmark's "no moves" case)
    (PolicyConfig(move_budget_min=1, move_budget_ratio=0.1), HELD, 12, [4]),  # budget max(1, 0.1 x 12) = 1
    (PolicyConfig(move_budget_min=2, move_budget_ratio=0.1), HELD, 12, [4, 3]),
    (PolicyConfig(), [HeldRequest(k, t, moved_before=True) for k, t in ((1, 5.5), (2, 7.0), (3, 8.0), (4, 9.5))],
     12, []),  # a request moves at most once
    (PolicyConfig(), [HeldRequest(1, 5.5), HeldRequest(4, 9.5, moved_before=True)], 12, []),  # #1 is nearly done
    (PolicyConfig(), [], 12, []),
])
def test_moves_are_bounded_by_the_switch_the_budget_and_once_per_request(cfg, held, active, expect):
    reps = ejected_fleet()
    assert [k for k, _ in held_to_move(10.0, reps[3], held, reps, cfg, active)] == expect


def test_no_move_when_every_other_replica_would_finish_later_or_none_is_left():
    reps = ejected_fleet()
    for r in reps[:3]:
        r.outstanding = 40  # 20.5 s expected anywhere else: the queue on r3 is the shorter wait
    assert held_to_move(10.0, reps[3], HELD, reps, PolicyConfig(), active=130) == []
    for r in reps[:3]:
        r.healthy = False
    assert held_to_move(10.0, reps[3], HELD, reps, PolicyConfig(), active=12) == []
