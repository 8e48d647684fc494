"""The tail with one 10x slow replica, in the simulator (deterministic): hedging's decisions and what the
model of a one-request-at-a-time replica must never do."""

from __future__ import annotations

from phalanx.serve.loadtest import poisson_arrivals_s
from phalanx.serve.routing_policy import Policy, PolicyConfig
from phalanx.serve.serving_faults import ServingFault
from phalanx.serve.sim_serve import ServeSim, SimServeConfig
from phalanx.sim.loop import VirtualTimeLoop

SLOW = [ServingFault("straggler", 3, 0.0, None, 10.0, 1)]
BASE = dict(replicas=4, rate_per_s=0.7 * 4 / 0.1, duration_s=60, service_s=0.1, seed=3)  # 70 % of healthy capacity


def run(cfg: SimServeConfig, faults: list[ServingFault]) -> tuple[dict, ServeSim]:
    sim = ServeSim(cfg, faults)
    loop = VirtualTimeLoop(cfg.seed)
    try:
        return loop.run_until_complete(sim.run()), sim
    finally:
        loop.close()


def test_a_one_slot_replica_serves_one_request_at_a_time_so_an_overload_queues():
    # 1 replica, 100 ms a request, 20 requests arriving at once: the last waits for the 19 before it
    cfg = SimServeConfig(replicas=1, service_s=0.1, arrivals_s=tuple(0.0 for _ in range(20)), seed=1)
    res, sim = run(cfg, [])
    assert res["ok"] == 20 and max(sim.latencies_s) >= 20 * 0.08  # each takes at least 80 ms, one after another
    assert sorted(sim.latencies_s)[0] <= 0.12


def test_with_a_slow_replica_p2c_latency_with_hedging_keeps_the_tail_below_round_robin_within_the_hedge_budget():
    rr, _ = run(SimServeConfig(policy=Policy.ROUND_ROBIN, **BASE), SLOW)
    hedged, _ = run(SimServeConfig(policy=Policy.P2C_LATENCY, hedging=True, **BASE), SLOW)
    assert hedged["failed"] == 0 and hedged["unfinished"] == 0
    assert 0 < hedged["hedges"] <= 0.1 * hedged["requests"]
    assert hedged["latency_s"]["p99"] < 0.5 * rr["latency_s"]["p99"]


def test_a_hedge_loser_is_cancelled_at_its_replica_so_no_replica_finishes_an_answer_nobody_needs():
    res, _ = run(SimServeConfig(policy=Policy.P2C_LATENCY, hedging=True, **BASE), SLOW)
    assert res["hedges"] > 0
    assert res["served"] == res["ok"]  # one finished answer per request: every loser freed its slot unfinished


def test_the_simulator_replays_a_given_arrival_schedule_after_a_warm_up():
    arrivals = poisson_arrivals_s(20.0, 5.0, seed=7)
    cfg = SimServeConfig(replicas=4, service_s=0.1, arrivals_s=tuple(arrivals),
                         warmup_arrivals_s=tuple(poisson_arrivals_s(20.0, 2.0, seed=99)), seed=2)
    res, sim = run(cfg, [])
    assert res["requests"] == len(arrivals) == res["ok"]  # the warm-up is not counted
    assert sorted(round(s, 9) for s in sim.starts_s) == [round(a, 9) for a in arrivals]


def test_with_ejection_the_slow_replicas_queued_requests_move_and_round_robins_tail_shrinks():
    # round-robin keeps feeding the 10x slow replica until passive ejection (10 of its answers) takes it out;
    # without moves the requests already queued there wait out its backlog (p99 ~47-59 s over seeds 1-3)
    kept, _ = run(SimServeConfig(policy=Policy.ROUND_ROBIN, policy_config=PolicyConfig(ejection_moves=False), **BASE),
                  SLOW)
    moved, sim = run(SimServeConfig(policy=Policy.ROUND_ROBIN, **BASE), SLOW)
    assert kept["moves"] == 0 and kept["failed"] == 0 and kept["unfinished"] == 0
    assert moved["failed"] == 0 and moved["unfinished"] == 0 and moved["ok"] == moved["requests"]
    assert 0 < moved["moves"] <= 0.1 * moved["requests"]  # bounded: no retry storm
    assert moved["served"] == moved["ok"]  # each moved request was cancelled at the slow replica: one answer each
    assert moved["latency_s"]["p99"] < 0.5 * kept["latency_s"]["p99"]


def test_later_moves_off_an_ejected_replica_shrink_round_robins_tail_further_within_the_move_bounds():
    # at the ejection a request stays where it is expected to finish sooner; re-deciding at every membership tick
    # while the replica stays ejected moves those that waited past that estimate (p99 11.9 -> 8.9 s, seed 3)
    once, _ = run(SimServeConfig(policy=Policy.ROUND_ROBIN, policy_config=PolicyConfig(ejection_moves_later=False),
                                 **BASE), SLOW)
    later, _ = run(SimServeConfig(policy=Policy.ROUND_ROBIN, **BASE), SLOW)
    assert later["failed"] == 0 and later["unfinished"] == 0 and later["served"] == later["ok"] == later["requests"]
    assert once["moves"] < later["moves"] <= 0.1 * later["requests"]
    assert later["latency_s"]["p99"] < 0.85 * once["latency_s"]["p99"]


BOTH_FROZEN = [ServingFault("freeze", 0, 5.0, 1.0, 1.0, 1), ServingFault("freeze", 1, 5.0, 1.0, 1.0, 2)]


def test_a_brief_outage_of_every_replica_delays_requests_instead_of_failing_them():
    # both replicas out of rotation for ~1.1 s (5.1 -> 6.2 virtual s): with the router's outage wait every request
    # waits and is answered; refusing at once (outage_wait_s = 0, the router before session 15) fails 8-12 of ~100
    base = dict(replicas=2, rate_per_s=10, duration_s=10, service_s=0.1, seed=1)
    refused, _ = run(SimServeConfig(outage_wait_s=0.0, **base), BOTH_FROZEN)
    waited, _ = run(SimServeConfig(**base), BOTH_FROZEN)
    assert refused["failed"] > 0
    assert waited["failed"] == 0 and waited["unfinished"] == 0 and waited["ok"] == waited["requests"]


def test_an_outage_longer_than_the_wait_still_answers_every_request_with_an_error_and_ends():
    gone = [ServingFault("kill", 0, 5.0, None, 1.0, 1), ServingFault("kill", 1, 5.0, None, 1.0, 2)]  # no restart
    res, _ = run(SimServeConfig(replicas=2, rate_per_s=10, duration_s=10, service_s=0.1, seed=1), gone)
    assert res["failed"] > 0 and res["unfinished"] == 0 and res["ok"] + res["failed"] == res["requests"]
