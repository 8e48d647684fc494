"""The production coordinator and worker protocol on simulated machines: scenarios, invariants,
determinism, and proof that the checkers catch a broken protocol."""

import json
import os
import subprocess
import sys

import pytest

from phalanx.core.errors import FaultPlanError
from phalanx.faults.plan import parse_fault_plan
from phalanx.sim.cluster import Cluster
from phalanx.sim.sweep import random_schedule, run_schedule, shrink


def _plan(text: str):
    return parse_fault_plan(text, "<test>")


def _strict(r):
    s = r.summary
    assert r.ok, (r.reason, r.violations)
    assert s["steps_committed"] == s["steps"] and s["samples_exactly_once"]
    assert s["reference_max_abs_diff"] is not None and s["reference_max_abs_diff"] < 1e-9


def test_fault_free_cluster_trains_like_one_machine_with_no_suspicions():
    r = Cluster(workers=8, steps=30, seed=3).run()
    _strict(r)
    assert r.summary["steps_retried"] == 0
    assert not [e for e in r.events if e["event"] == "worker_suspected"]


def test_crash_freeze_hang_and_partition_are_survived_with_strict_equality():
    plan = _plan('[[fault]]\nkind = "kill"\nworker = 3\nat_step = 10\n'
                 '[[fault]]\nkind = "freeze"\nworker = 1\nat_step = 20\nfor_s = 2.0\n'
                 '[[fault]]\nkind = "hang"\nworker = 2\nat_step = 30\nfor_s = 3.0\n'
                 '[[fault]]\nkind = "partition"\ngroups = [[0, 1, 2, 3, 4], [5, 6, 7]]\nat_step = 40\nfor_s = 3.0\n')
    r = Cluster(workers=8, steps=130, seed=5, plan=plan).run()
    _strict(r)
    faults = {f["kind"]: f for f in r.summary["faults"]}
    assert faults["kill"]["detected_after_s"] < 0.1
    assert faults["freeze"]["detected_after_s"] < 1.0
    assert 1.9 < faults["hang"]["detected_after_s"] < 3.0  # the progress watch, not heartbeats
    assert faults["partition"]["detected_after_s"] < 1.0
    # the minority side never committed while cut off; it healed from the majority afterwards
    cut = next(e["t"] for e in r.events if e["event"] == "fault_injected" and e["kind"] == "partition")
    healed = next(e["t"] for e in r.events if e["event"] == "partition_healed")
    during = [e for e in r.events if e["event"] == "step_committed" and cut + 1.0 < e["t"] < healed]
    assert during and all(not {"w5", "w6", "w7"} & set(e["members"]) for e in during)
    assert any(e["event"] == "worker_healed" and e["worker"] in ("w5", "w6", "w7") and e["t"] > healed
               for e in r.events)


def test_the_same_seed_replays_the_same_trace_and_another_seed_differs():
    plan = _plan('[[fault]]\nkind = "kill"\nworker = 1\nat_step = 5\n'
                 '[[fault]]\nkind = "loss"\nprobability = 0.02\nat_step = 8\nfor_s = 2\n')
    a = Cluster(workers=6, steps=25, seed=11, plan=plan).run()
    b = Cluster(workers=6, steps=25, seed=11, plan=plan).run()
    c = Cluster(workers=6, steps=25, seed=12, plan=plan).run()
    assert a.digest == b.digest and a.digest != c.digest


def test_the_trace_digest_does_not_depend_on_hash_randomisation(tmp_path):
    code = ("from phalanx.sim.cluster import Cluster; from phalanx.faults.plan import parse_fault_plan;"
            "p = parse_fault_plan('[[fault]]\\nkind = \"partition\"\\nisolate = 2\\nat_step = 4\\nfor_s = 1.5\\n');"
            "print(Cluster(workers=5, steps=15, seed=4, plan=p).run().digest)")
    digests = set()
    for hashseed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        digests.add(out.stdout.strip().splitlines()[-1])
    assert len(digests) == 1


# seeds 0..7 at 8 workers, plus ones a longer sweep once failed on: 148 and 212 (a frozen worker
# reached a restarted coordinator first, which committed old steps again with it alone), 21449 (the
# same one step behind) and 20376 (a kill of a worker whose restart was pending started a second one)
@pytest.mark.parametrize("seed,workers,steps", [(s, 8, 30) for s in range(8)]
                         + [(148, 8, 40), (212, 8, 40), (21449, 6, 50), (20376, 6, 50)])
def test_fixed_sweep_seeds_hold_every_invariant_and_stay_live(seed, workers, steps):
    faults = random_schedule(seed, workers, steps)
    r = run_schedule(seed, workers, steps, faults)
    assert r.ok, (seed, r.reason, r.violations, faults)
    assert r.summary["steps_committed"] == steps


def test_the_checkers_catch_a_protocol_that_reuses_an_epoch(monkeypatch):
    # A deliberately broken quorum rule (keep the old quorum id after a membership change, so
    # fencing cannot tell epochs apart) must be caught by the invariant checker.
    import dataclasses

    from phalanx.membership import coordinator

    real = coordinator.decide_quorum

    def no_new_epoch(now, members, view, cfg):
        d = real(now, members, view, cfg)
        return dataclasses.replace(d, quorum_id=max(1, view.current_id)) if d.quorum_id else d

    monkeypatch.setattr(coordinator, "decide_quorum", no_new_epoch)
    plan = _plan('[[fault]]\nkind = "kill"\nworker = 2\nat_step = 3\n')
    r = Cluster(workers=4, steps=10, seed=1, plan=plan).run()
    # fencing cannot tell the epochs apart: every re-formed quorum is "broken" at once, so the
    # liveness bound trips (or a safety invariant does first)
    assert not r.ok
    assert r.violations or r.reason.startswith("no step committed for 120 virtual s"), r.reason


def test_shrinking_keeps_only_the_faults_that_matter():
    faults = [{"kind": "latency", "mean_ms": 1.0, "at_step": 2, "for_s": 1.0},
              {"kind": "kill", "worker": 1, "at_step": 3},
              {"kind": "straggler", "worker": 0, "factor": 2.0, "at_step": 4, "for_s": 1.0}]
    kept = shrink(0, 4, 10, faults, still_fails=lambda fs: any(f["kind"] == "kill" for f in fs))
    assert kept == [faults[1]]


def test_simulator_only_network_faults_are_refused_clearly_by_the_real_runtime():
    # TCP hides duplication and reordering; only the simulator models what they cost
    for kind in ('kind = "duplicate"\nprobability = 0.1', 'kind = "reorder"\nprobability = 0.1\ndelay_ms = 5'):
        with pytest.raises(FaultPlanError, match="not supported by the real runtime"):
            _plan(f"[[fault]]\n{kind}\nat_step = 2\n").require_supported("real")


def test_sim_run_cli_writes_the_real_run_layout(tmp_path):
    from phalanx.cli.main import main

    plan = tmp_path / "p.toml"
    plan.write_text('[[fault]]\nkind = "kill"\nworker = 0\nat_step = 4\n')
    assert main(["sim", "run", "--workers", "4", "--steps", "12", "--seed", "2", "--fault-plan", str(plan),
                 "--out", str(tmp_path / "run")]) == 0
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["simulated"] and s["steps_committed"] == 12 and s["goodput_vs_fault_free"] <= 1.0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 12 and {"step", "quorum_id", "members", "loss", "step_s"} <= set(json.loads(lines[0]))
    assert (tmp_path / "run" / "events.jsonl").exists() and (tmp_path / "run" / "workers" / "w1.jsonl").exists()


def test_a_schedule_that_kills_every_holder_of_the_state_is_an_expected_stop_not_a_failure():
    # 2 workers: w0 dies at step 8 and is still restarting when w1, the only holder, dies at 11
    from phalanx.sim.sweep import expected_stop

    faults = [{"kind": "kill", "at_step": 8, "worker": 0}, {"kind": "kill", "at_step": 11, "worker": 1}]
    r = run_schedule(80013, 2, 40, faults)
    assert not r.ok and not r.violations and "no connected worker holds step" in r.reason
    assert r.summary["all_state_lost"]["step"] == 10 and expected_stop(r)
    # one holder left (w1 killed while w0 is alive and current) is no excuse: it must go on
    r2 = run_schedule(80013, 2, 40, [{"kind": "kill", "at_step": 11, "worker": 1}])
    assert r2.ok and r2.summary["all_state_lost"] is None and not expected_stop(r2)


def test_a_recovery_does_not_wait_for_a_returning_workers_heal():
    """w1 is killed and comes back (2 s later) while w2 is frozen: the quorum that redoes the
    step after w2's abort is formed from the members that hold the state, and w1 heals into the
    next one, right after their commit. The production coordinator's policy, in the simulator."""
    plan = _plan('[[fault]]\nkind = "kill"\nworker = 1\nat_step = 10\nrestart = true\n'
                 '[[fault]]\nkind = "freeze"\nworker = 2\nat_s = 2.0\nfor_s = 2.0\n')
    r = Cluster(workers=4, steps=120, seed=11, plan=plan).run()
    _strict(r)
    ev = r.events
    joined = next(e for e in ev if e["event"] == "worker_joined" and e["worker"] == "w1" and e["t"] > 0.5)
    aborted = next(e for e in ev if e["event"] == "step_aborted" and "w2" in e["reason"])
    assert joined["t"] < aborted["t"], "w1 is back and asking while the frozen w2 holds up the step"
    formed = [e for e in ev if e["event"] == "quorum_formed" and e["t"] >= aborted["t"]]
    assert formed[0]["members"] == ["w0", "w3"] and "healing" not in formed[0]["reason"]
    assert formed[1]["members"] == ["w0", "w1", "w3"] and "healing ['w1']" in formed[1]["reason"]
    between = [e for e in ev if e["event"] == "step_committed" and formed[0]["t"] <= e["t"] <= formed[1]["t"]]
    assert between and between[0]["members"] == ["w0", "w3"], "the survivors committed before w1 was taken in"
