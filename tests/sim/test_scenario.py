"""Protocol specifications written in the scenario vocabulary: each names a guarantee and checks it
from the run's own record (events, commit records, the steps each worker applied), not just ``ok``."""

import dataclasses

import pytest

from phalanx.core.errors import FaultPlanError
from phalanx.faults.plan import parse_fault_plan
from phalanx.sim.scenario import Scenario


def _held(r):
    assert r.ok, (r.reason, r.violations)
    assert r.summary["samples_exactly_once"] and r.summary["reference_max_abs_diff"] < 1e-9


def _redone_only_at_the_kill(r, restarted_s, step):
    """A kill that lands within 5 ms of ``step``'s commit may fall after the dead incarnation
    recorded it but before any worker heard of it: every worker rolled it back and the new
    incarnation committed it again under a higher id (commit_log.py). Nothing else is redone."""
    for lost in r.superseded:
        again = next(c for c in r.commits if c["step"] == lost["step"])
        assert lost["step"] == step and again["quorum_id"] > lost["quorum_id"], r.superseded
        assert again["committed_at_s"] > restarted_s


# ---- the vocabulary itself ----

def test_a_scenario_builds_the_faults_a_plan_file_would():
    s = (Scenario(workers=4, seed=7)
         .crash(3, at_step=10)
         .freeze(1, at_s=2.0, for_s=1.5)
         .partition([0, 1], [2, 3], at_step=20, for_s=5.0)
         .latency(mean_ms=5, jitter_ms=2, at_s=0)
         .reorder(probability=0.1, delay_ms=3, at_step=4, for_s=1.0, pair=[0, 2])
         .kill_coordinator(at_step=30, restart_after_s=0.5))
    text = ('[[fault]]\nkind = "kill"\nworker = 3\nat_step = 10\n'
            '[[fault]]\nkind = "freeze"\nworker = 1\nat_s = 2.0\nfor_s = 1.5\n'
            '[[fault]]\nkind = "partition"\ngroups = [[0, 1], [2, 3]]\nat_step = 20\nfor_s = 5.0\n'
            '[[fault]]\nkind = "latency"\nmean_ms = 5\njitter_ms = 2\nat_s = 0\n'
            '[[fault]]\nkind = "reorder"\nprobability = 0.1\ndelay_ms = 3\nat_step = 4\nfor_s = 1.0\npair = [0, 2]\n'
            '[[fault]]\nkind = "coordinator_kill"\nat_step = 30\nrestart_after_s = 0.5\n')

    def same(faults):
        return [dataclasses.replace(f, line=0) for f in faults]

    assert same(s.plan.faults) == same(parse_fault_plan(text).faults)
    assert same(parse_fault_plan(s.toml()).faults) == same(s.plan.faults)  # toml() is the plan file


def test_a_bad_scenario_call_fails_at_once_with_the_plan_parsers_message():
    with pytest.raises(FaultPlanError, match="'for_s' must be a number > 0, got 0"):
        Scenario(workers=4).freeze(1, at_s=1.0, for_s=0)
    with pytest.raises(FaultPlanError, match="give exactly one trigger"):
        Scenario(workers=4).crash(1)
    with pytest.raises(FaultPlanError, match="'probability' must be in"):
        Scenario(workers=4).duplicate(probability=1.0, at_step=1)
    with pytest.raises(FaultPlanError, match="does not exist in a run of 4 workers"):
        Scenario(workers=4).crash(4, at_step=1).run_until(step=5)
    with pytest.raises(FaultPlanError, match="'pair' must name two different workers"):
        Scenario(workers=4).loss(probability=0.1, at_step=1, pair=[2, 2]).run_until(step=5)


# ---- membership and commit ----

def test_minority_side_of_partition_never_commits():
    r = Scenario(workers=5, seed=3).partition([0, 1, 2], [3, 4], at_step=10, for_s=3.0).run_until(step=40)
    _held(r)
    cut, healed = r.first("fault_injected")["t"], r.first("partition_healed")["t"]
    for w in (3, 4):
        assert not [s for t, s in r.applied_by(w) if cut < t < healed], f"w{w} applied a step while cut off"
        assert not [c for c in r.commits_between(cut, healed) if f"w{w}" in c["members"]]
        assert r.first("worker_healed", w, after_s=healed)  # caught up from the majority afterwards
    majority = r.commits_between(cut, healed)
    assert len(majority) > 20 and all(c["members"] == ["w0", "w1", "w2"] for c in majority)


def test_crashed_worker_restarts_heals_and_rejoins():
    r = Scenario(workers=4, seed=5).crash(3, at_step=10).run_until(step=70)
    _held(r)
    killed = r.first("fault_injected", 3)["t"]
    assert r.first("worker_suspected", 3)["t"] - killed < 0.01  # the reset connection says so at once
    joins = r.events_of("worker_joined", 3)
    assert len(joins) == 2 and joins[1]["incarnation"] != joins[0]["incarnation"]
    assert joins[1]["last_committed_step"] == -1  # a fresh process has no state ...
    healed = r.first("worker_healed", 3, after_s=joins[1]["t"])
    assert healed and healed["step"] > 10  # ... so it copies a peer's, not the initial one
    rejoined = [s for t, s in r.applied_by(3) if t > healed["t"]]
    assert rejoined == list(range(healed["step"], 70))  # then it commits every remaining step
    assert not [c for c in r.commits_between(killed, healed["t"]) if "w3" in c["members"]]


def test_frozen_worker_is_suspected_and_rejoins_after_thaw():
    r = Scenario(workers=4, seed=5).freeze(1, at_step=8, for_s=2.0).run_until(step=60)
    _held(r)
    frozen = r.first("fault_injected", 1)["t"]
    suspected = r.first("worker_suspected", 1)
    assert suspected["reason"].startswith("no heartbeat") and suspected["t"] - frozen < 1.0
    back = r.first("worker_alive_again", 1)
    assert back["t"] >= frozen + 2.0  # not before the thaw
    assert len(r.events_of("worker_joined", 1)) == 1  # the same process: nothing restarted it
    assert not [s for t, s in r.applied_by(1) if frozen < t < back["t"]]
    assert r.first("worker_healed", 1, after_s=back["t"])  # it fell behind, so it heals
    assert r.committed_by(1)[-1] == 59


def test_hung_worker_that_heartbeats_is_caught_by_progress_watch():
    r = Scenario(workers=4, seed=5).hang(2, at_step=8, for_s=4.0).run_until(step=90)
    _held(r)
    hung = r.first("fault_injected", 2)["t"]
    suspicions = r.events_of("worker_suspected", 2)
    assert [s["reason"].split(" for")[0] for s in suspicions] == ["no step progress"]  # never "no heartbeat"
    assert 2.0 <= suspicions[0]["t"] - hung < 2.5  # progress_timeout_s, not the 5 s collective deadline
    back = r.first("worker_alive_again", 2)
    assert back["t"] >= hung + 4.0
    assert [s for t, s in r.applied_by(2) if t > back["t"]][-1] == 89


# Found by a denser sweep (seed 95104, 4 workers x 60 steps, up to 8 faults): w1 asked for a quorum
# 4 ms before it was cut off; the coordinator suspected it (no heartbeat) and dropped its request;
# when the partition healed its heartbeats cleared the suspicion but not the drop, so w1 waited for
# an answer that never came while every quorum formed without it (300 s in a real run).
def test_a_worker_suspected_while_its_quorum_request_was_pending_is_taken_back_when_it_returns():
    r = (Scenario(workers=4, seed=95104)
         .freeze(0, at_step=13, for_s=1.67).isolate(1, for_s=3.47, at_step=29)
         .kill_coordinator(at_step=12, restart_after_s=1.41).crash(3, at_step=27).hang(0, at_step=14, for_s=3.98)
         .run_until(step=60))
    _held(r)
    assert r.first("worker_suspected", 1)["reason"].startswith("no heartbeat")
    healed = r.first("partition_healed")["t"]
    back = r.first("quorum_formed", after_s=healed)
    assert "w1" in back["members"] and back["t"] - healed < 1.0
    assert r.summary["workers_completed"] == 4


# ---- the coordinator ----

def test_quorum_ids_stay_above_every_id_after_coordinator_restart():
    r = (Scenario(workers=4, seed=1)
         .crash(2, at_step=5)  # a membership change first, so the old coordinator used several ids
         .kill_coordinator(at_step=60, restart_after_s=1.0)
         .run_until(step=90))
    _held(r)
    restarted = r.events_of("coordinator_started")[1]["t"]
    before = [qid for t, qid, _ in r.quorums() if t < restarted]
    after = [qid for t, qid, _ in r.quorums() if t >= restarted]
    assert len(before) >= 2 and after and min(after) > max(before)
    steps = [c["step"] for c in r.commits]
    assert steps == list(range(90))  # no committed step lost
    _redone_only_at_the_kill(r, restarted, 59)
    assert r.commits_between(restarted, 1e9)[0]["step"] == r.commits_between(0, restarted)[-1]["step"] + 1
    assert r.summary["coordinator_restarts"] == 1 and r.summary["workers_completed"] == 4
    assert len({e["incarnation"] for e in r.events_of("worker_joined", 0)}) == 1  # workers reconnected


def test_a_commit_decision_that_dies_with_the_coordinator_is_redone_not_lost():
    # Kill the coordinator 50 us after it decides step 12: the decision is still in flight to every
    # worker (latency 200 us), so no worker applies it, and the new coordinator must redo step 12.
    base = Scenario(workers=4, seed=3).run_until(step=30)
    decided = next(c["committed_at_s"] for c in base.commits if c["step"] == 12)
    first = base.commits[0]["committed_at_s"]  # at_s counts from the first commit (faults/timeline.py)
    r = Scenario(workers=4, seed=3).kill_coordinator(at_s=decided - first + 50e-6).run_until(step=30)
    _held(r)
    assert [c["step"] for c in r.superseded] == [12]  # decided by the dead incarnation ...
    assert not [s for t, s in r.applied_by(0) if s == 12 and t < r.superseded[0]["committed_at_s"] + 0.5]
    assert [c["step"] for c in r.commits] == list(range(30))  # ... and committed once by the new one


# Found by this simulator: a restarted coordinator used to wait initial_wait_s for every expected worker.
def test_a_restarted_coordinator_does_not_wait_the_job_start_window_for_a_dead_worker():
    r = (Scenario(workers=4, seed=1)
         .crash(3, at_step=5, restart=False)
         .kill_coordinator(at_step=10, restart_after_s=0.5)
         .run_until(step=30))
    _held(r)
    restarted = r.events_of("coordinator_started")[1]["t"]
    assert r.first("quorum_formed", after_s=restarted)["t"] - restarted < 5.0


# Found by this simulator: WorkerAgent.start() used to connect once and give up during an outage.
def test_a_worker_restarted_during_a_coordinator_outage_rejoins():
    r = (Scenario(workers=4, seed=1)
         .crash(3, at_step=10)  # its restart, 2 s later, falls inside the coordinator's 3 s outage
         .kill_coordinator(at_step=12, restart_after_s=3.0)
         .run_until(step=40))
    assert r.ok, (r.reason, r.violations)
    assert r.summary["workers_completed"] == 4, r.summary["workers_incomplete"]


# Found by the sweep (seeds 148, 212 of `random_schedule(seed, 8, 40)`): a worker frozen before a
# coordinator kill reached the restarted coordinator first, and it formed a quorum with that worker
# alone, reusing quorum id 2 and committing steps 7.. again over the ones its peers had applied.
def test_a_worker_frozen_across_a_coordinator_restart_heals_instead_of_recommitting_steps():
    r = (Scenario(workers=4, seed=212)
         .freeze(0, at_step=7, for_s=3.7)  # thaws during the outage: it reconnects before its peers
         .kill_coordinator(at_step=13, restart_after_s=2.85)
         .run_until(step=40))
    _held(r)
    restarted = r.events_of("coordinator_started")[1]
    # the durable floor: the dead incarnation committed step 12, so every member applied step 11
    assert restarted["cluster_step"] == 11
    stale = r.first("worker_joined", 0, after_s=restarted["t"])
    assert stale["last_committed_step"] < 11 and stale["t"] < r.first("worker_joined", 1, after_s=restarted["t"])["t"]
    before = [qid for t, qid, _ in r.quorums() if t < restarted["t"]]
    after = [(qid, members) for t, qid, members in r.quorums() if t >= restarted["t"]]
    assert min(q for q, _ in after) > max(before) and len(after[0][1]) == 4  # nobody formed with w0 alone
    healed = [e for e in r.events_of("worker_healed", 0) if e["t"] >= restarted["t"]]
    first_step = r.commits_between(restarted["t"], 1e9)[0]["step"]  # 12 again if its decision died in flight
    assert healed and healed[0]["step"] == first_step and healed[0]["source"] != "w0"
    assert [c["step"] for c in r.commits] == list(range(40))
    _redone_only_at_the_kill(r, restarted["t"], 12)


# Found by the sweep (seed 21449, 6 workers x 50 steps): the coordinator died right after committing
# step 3, which w1..w5 applied; w0, hung through step 3, reached the new coordinator first holding
# step 2, and a quorum with it alone committed step 3 again. Now the new incarnation waits for the
# last recorded commit's members before it forms at that step.
def test_after_a_restart_no_quorum_forms_at_the_last_commits_step_before_its_members_are_back():
    r = (Scenario(workers=6, seed=21449)
         .gil_hang(0, at_step=3, for_s=2.18)
         .kill_coordinator(at_step=4, restart_after_s=2.0)
         .run_until(step=50))
    _held(r)
    restarted = r.events_of("coordinator_started")[1]["t"]
    stale = r.first("worker_joined", 0, after_s=restarted)
    assert stale["last_committed_step"] == 2 and r.first("worker_joined", 1, after_s=restarted)["t"] > stale["t"]
    first = r.first("quorum_formed", after_s=restarted)
    assert first["step"] == 4 and len(first["members"]) == 6  # step 3 was not redone
    assert [c["step"] for c in r.commits] == list(range(50)) and not r.superseded


# Found by the sweep (seed 20376): a second kill of a worker whose restart was still pending started
# a second process for it; the two incarnations kept replacing each other and it never finished.
def test_killing_a_worker_that_is_already_dead_does_nothing():
    r = Scenario(workers=6, seed=20376).crash(2, at_step=26).crash(2, at_step=30).run_until(step=100)
    _held(r)
    assert r.summary["workers_completed"] == 6
    assert len({e["incarnation"] for e in r.events_of("worker_joined", 2)}) == 2  # the first, and one restart
    assert [e["worker"] for e in r.events_of("fault_skipped")] == ["w2"]


# Found by a denser sweep (seed 100856): all four workers reconnected to the restarted coordinator
# within a microsecond, but it formed a quorum with the first alone; that worker then died holding
# the only copy of the step it committed, and the job could not go on.
def test_a_restarted_coordinator_waits_for_the_last_quorum_before_it_forms_again():
    r = (Scenario(workers=4, seed=100856)
         .latency(mean_ms=30.0, jitter_ms=4.1, at_step=3, for_s=2.65)
         .kill_coordinator(at_step=20, restart_after_s=2.91)
         .crash(0, at_step=21)
         .run_until(step=60))
    _held(r)
    restarted = r.events_of("coordinator_started")[1]["t"]
    assert r.first("quorum_formed", after_s=restarted)["members"] == ["w0", "w1", "w2", "w3"]
    assert r.summary["all_state_lost"] is None


# ---- the cross-incarnation checkers catch a coordinator that forgets ----

def _restart_run():
    return (Scenario(workers=4, seed=1).crash(2, at_step=5).kill_coordinator(at_step=20, restart_after_s=0.5)
            .run_until(step=40))


def test_the_checkers_catch_a_restarted_coordinator_that_reuses_old_quorum_ids(monkeypatch):
    from phalanx.membership import coordinator

    real = coordinator.decide_quorum

    def forget_worker_ids(now, members, view, cfg):  # ignores the ids the workers' Hellos report
        return real(now, members, dataclasses.replace(view, max_id_seen=0), cfg)

    monkeypatch.setattr(coordinator, "decide_quorum", forget_worker_ids)
    r = _restart_run()
    assert not r.ok and any("fencing cannot tell them apart" in v for v in r.violations), r.violations


def test_the_checkers_catch_a_restarted_coordinator_that_loses_committed_steps(monkeypatch):
    import msgspec

    from phalanx.membership.coordinator import Coordinator

    real = Coordinator._admit

    def forget_progress(self, hello, conn):  # as if the Hellos said nothing about the workers' state
        return real(self, msgspec.structs.replace(hello, has_state=False, last_committed_step=-1), conn)

    monkeypatch.setattr(Coordinator, "_admit", forget_progress)
    monkeypatch.setattr(Coordinator, "raise_floor", lambda self, *floor: None)  # and the durable floor
    r = _restart_run()
    assert not r.ok and any("a committed step was lost" in v for v in r.violations), r.violations


def test_new_fault_kinds_replay_identically_under_any_hash_seed():
    import os
    import subprocess
    import sys

    code = ("from phalanx.sim.scenario import Scenario;"
            "r = (Scenario(workers=5, seed=9).duplicate(probability=0.2, at_step=2, for_s=1.0, workers=[1])"
            ".reorder(probability=0.2, delay_ms=4, at_step=3, for_s=1.0).loss(probability=0.05, at_step=4, pair=[0, 3])"
            ".crash(4, at_step=6).kill_coordinator(at_step=8, restart_after_s=0.4).run_until(step=20));"
            "assert r.ok, r.violations; print(r.digest)")
    digests = set()
    for hashseed in ("0", "4242"):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": hashseed},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        digests.add(out.stdout.strip().splitlines()[-1])
    assert len(digests) == 1


def test_a_killed_worker_process_never_talks_again():
    # seed 22 kills w2 while it waits for a quorum: the cancelled wait_for can swallow the
    # cancellation (Python 3.11) and reconnect as the old process unless the network refuses it
    r = Scenario(workers=4, seed=22).crash(2, at_step=6).run_until(step=15)
    _held(r)
    killed = r.first("fault_injected", 2)["t"]
    joins = r.events_of("worker_joined", 2)
    assert [e["incarnation"] for e in joins if e["t"] > killed] == [joins[-1]["incarnation"]]
    assert joins[-1]["incarnation"] != joins[0]["incarnation"]


def test_available_mode_in_the_simulator_hands_a_straggler_less_work_and_stays_exact():
    from phalanx.core.modes import ConsistencyMode, ModeConfig
    from phalanx.faults.plan import parse_fault_plan
    from phalanx.sim.cluster import Cluster

    plan = parse_fault_plan('[[fault]]\nkind = "straggler"\nworker = 3\nfactor = 3.0\nat_step = 2\n', "<t>")
    strict = Cluster(workers=4, steps=30, seed=3, plan=plan).run()
    avail = Cluster(workers=4, steps=30, seed=3, plan=plan, modes=ModeConfig(mode=ConsistencyMode.AVAILABLE)).run()
    assert strict.ok and avail.ok, (strict.reason, avail.reason, avail.violations)
    assert avail.summary["samples_exactly_once"] and avail.summary["reference_max_abs_diff"] <= 1e-9
    # the straggler no longer sets the pace: the same 30 steps take less virtual time
    assert avail.summary["virtual_s"] < 0.8 * strict.summary["virtual_s"]


def test_sizes_only_collectives_charge_a_large_models_gradient_bytes():
    from phalanx.faults.plan import EMPTY_PLAN
    from phalanx.sim.cluster import Cluster

    small = Cluster(workers=8, steps=10, seed=1, plan=EMPTY_PLAN).run()
    large = Cluster(workers=8, steps=10, seed=1, plan=EMPTY_PLAN, gradient_bytes=2_000_000_000).run()
    assert small.ok and large.ok
    # 8-rank ring at 1.25 GB/s: 2 * 7/8 * 2 GB / 1.25 GB/s = 2.8 s more per step, the sum still exact
    extra_s = (large.summary["virtual_s"] - small.summary["virtual_s"]) / 10
    assert 2.5 < extra_s < 3.2 and large.summary["reference_max_abs_diff"] <= 1e-9


# ---- a worker that is not there at the start ----

def test_a_worker_that_joins_later_heals_from_a_peer_and_then_takes_part():
    r = Scenario(workers=4, seed=7).join(3, at_step=10).run_until(step=40)
    _held(r)
    first = r.quorums()[0]
    assert first[0] < 1.0 and first[2] == ["w0", "w1", "w2"]  # the first quorum does not wait for w3
    joined = r.events_of("worker_joined", 3)
    assert len(joined) == 1 and joined[0]["last_committed_step"] == -1  # started once, fresh, no state
    assert joined[0]["t"] >= r.first("fault_injected", 3)["t"]
    healed = r.first("worker_healed", 3)
    assert healed and healed["source"] in ("w0", "w1", "w2") and healed["step"] >= 10
    assert [c["members"] for c in r.commits if c["step"] < healed["step"]] == [["w0", "w1", "w2"]] * healed["step"]
    after = [c for c in r.commits if c["step"] >= healed["step"]]
    assert after and all("w3" in c["members"] for c in after)  # every commit after it joined includes it
    assert [s for _, s in r.applied_by(3)] == list(range(healed["step"], 40))
    assert r.summary["workers_completed"] == 4  # w3 ends with the reference parameters (_held checks them)
    f = r.fault("join")
    assert f["detected_after_s"] is None and f["recovered_after_s"] is not None


def test_a_join_that_comes_after_the_last_step_ends_the_job_without_the_worker():
    r = Scenario(workers=3, seed=2).join(2, at_step=50).run_until(step=20)
    _held(r)
    assert "w2 never joined" in r.reason and not r.events_of("worker_joined", 2)
    assert r.summary["workers_incomplete"] == {"w2": "the job finished before its join was due"}
