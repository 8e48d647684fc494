"""`phalanx sim serve`: the router's own decisions in virtual time; same seed, same result."""

from __future__ import annotations

from phalanx.serve.routing_policy import Policy
from phalanx.serve.serving_faults import ServingFault
from phalanx.serve.sim_serve import SimServeConfig, simulate
from phalanx.sim.loop import VirtualTimeLoop

SLOW = [ServingFault("straggler", 3, 0.0, None, 10.0, 1)]


def run(cfg: SimServeConfig, faults: list[ServingFault]) -> dict:
    loop = VirtualTimeLoop(cfg.seed)
    try:
        return loop.run_until_complete(simulate(cfg, faults))
    finally:
        loop.close()


def test_same_seed_gives_the_same_result_and_another_seed_another():
    cfg = SimServeConfig(replicas=8, rate_per_s=50, duration_s=10, seed=4)
    a, b = run(cfg, SLOW), run(cfg, SLOW)
    assert a == b
    assert run(SimServeConfig(replicas=8, rate_per_s=50, duration_s=10, seed=5), SLOW)["latency_s"] != a["latency_s"]


def test_latency_aware_choice_keeps_the_tail_near_healthy_where_round_robin_does_not():
    base = dict(replicas=8, rate_per_s=56, duration_s=20, seed=1)
    healthy = run(SimServeConfig(**base), [])["latency_s"]["p99"]
    rr = run(SimServeConfig(policy=Policy.ROUND_ROBIN, **base), SLOW)["latency_s"]["p99"]
    p2c = run(SimServeConfig(policy=Policy.P2C_LATENCY, **base), SLOW)["latency_s"]["p99"]
    assert p2c <= 1.5 * healthy < rr


def test_kill_freeze_hang_and_partition_cost_no_request_and_are_detected_within_a_second():
    faults = [ServingFault("kill", 1, 2.0, None, 1.0, 1), ServingFault("freeze", 2, 3.0, 2.0, 1.0, 2),
              ServingFault("hang", 4, 4.0, 2.0, 1.0, 3), ServingFault("partition", 5, 5.0, 2.0, 1.0, 4)]
    res = run(SimServeConfig(replicas=8, rate_per_s=50, duration_s=10, seed=2), faults)
    assert res["failed"] == 0 and res["ok"] == res["requests"]
    out = {m["replica"]: m["t_s"] for m in res["membership"] if not m["healthy"]}
    for f in faults:
        assert out[f"r{f.replica:03d}"] - f.at_s <= 1.0, (f.kind, out)
    back = {m["replica"] for m in res["membership"] if m["healthy"]}
    assert {"r002", "r004", "r005"} <= back and "r001" not in back  # the thawed, unhung and healed return


def test_the_cli_compares_the_policies_and_writes_results(tmp_path):
    from phalanx.cli.main import main

    plan = tmp_path / "plan.toml"
    plan.write_text('[[fault]]\nkind = "kill"\nworker = 1\nat_s = 1\n')
    assert main(["sim", "serve", "--replicas", "4", "--duration-s", "3", "--fault-plan", str(plan), "--seed", "1",
                 "--out", str(tmp_path / "out")]) == 0
    import json

    res = json.loads((tmp_path / "out" / "results.json").read_text())["results"]
    assert set(res) == {"healthy", "round-robin", "p2c-queue", "p2c-latency", "p2c-latency+hedge"}
    assert all(r["failed"] == 0 and r["ok"] == r["requests"] for r in res.values())


def test_a_killed_replica_with_restart_is_readmitted_in_the_simulator_too():
    faults = [ServingFault("kill", 1, 2.0, None, 1.0, 1, restart=True)]
    res = run(SimServeConfig(replicas=4, rate_per_s=20, duration_s=10, seed=2), faults)
    assert res["failed"] == 0
    r1 = [(m["t_s"], m["healthy"]) for m in res["membership"] if m["replica"] == "r001"]
    assert [h for _, h in r1] == [False, True] and r1[1][0] >= 2.0 + 3.0
