"""The coordinator crashes mid-run (all its state and connections dropped at once) and a brand-new
one starts on the same address: the job ends strict-equal, each step committed exactly once, and
every quorum id after the restart above every id before it (fencing survives the restart)."""

import json

import pytest

from phalanx.membership.coordinator import CommitRecord
from phalanx.membership.commit_log import merge_commits
from tests.integration.conftest import assert_strict, events, train

PACE = {"min_step_s": 0.08}  # steps still running when the coordinator comes back (see test_faults_real_processes)


def _worker_commits(run_dir, worker):
    lines = (run_dir / "workers" / f"{worker}.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if r.get("event") == "committed"]


def _each_step_committed_once(run_dir, steps, workers=("w0", "w1", "w2")):
    """metrics.jsonl holds each step once, and no worker applied a step twice; returns the records."""
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(steps))
    for w in workers:
        mine = _worker_commits(run_dir, w)
        assert mine == sorted(set(mine)), f"{w} committed a step twice: {mine}"
    return metrics


def test_coordinator_killed_at_step_10_restarts_and_the_job_ends_strict_equal(tmp_path):
    plan = '[[fault]]\nkind = "coordinator_kill"\nat_step = 10\nrestart_after_s = 1.0\n'
    s = train(tmp_path, plan, workers=3, steps=40, checkpoint_every_steps=5, **PACE)
    assert_strict(s)
    run = tmp_path / "run"
    evs = events(run)
    names = [e["event"] for e in evs]
    assert names.count("coordinator_started") == 2 and names.count("coordinator_crashed") == 1
    started = [e for e in evs if e["event"] == "coordinator_started"]
    assert started[0]["address"] == started[1]["address"], "the new coordinator listens on the same address"
    crash = names.index("coordinator_crashed")
    restart = names.index("coordinator_started", crash)
    assert evs[restart]["mono"] - evs[crash]["mono"] >= 0.95

    # no committed step lost or committed twice, across both incarnations
    metrics = _each_step_committed_once(run, 40)
    assert any(e["event"] == "step_committed" for e in evs[restart:]), "the new incarnation commits"

    # fencing: every quorum after the restart has a higher id than any quorum before the crash
    before = [e["quorum_id"] for e in evs[:crash] if e["event"] in ("quorum_formed", "step_committed")]
    after = [e["quorum_id"] for e in evs[restart:] if e["event"] in ("quorum_formed", "step_committed")]
    assert before and after and min(after) > max(before), (before, after)
    assert all(m["quorum_id"] > max(before) for m in metrics if m["step"] >= metrics[-1]["step"] - 5)

    f = s["faults"][0]
    assert f["kind"] == "coordinator_kill" and f["detected_after_s"] is not None and f["recovered_after_s"] is not None


@pytest.mark.slow
def test_two_coordinator_kills_one_at_a_commit_one_mid_step_keep_every_step_committed_once(tmp_path):
    plan = ('[[fault]]\nkind = "coordinator_kill"\nat_step = 8\nrestart_after_s = 0.5\n'
            '[[fault]]\nkind = "coordinator_kill"\nat_s = 3.55\nrestart_after_s = 1.0\n')
    s = train(tmp_path, plan, workers=3, steps=60, **PACE)
    assert_strict(s)
    run = tmp_path / "run"
    evs = events(run)
    _each_step_committed_once(run, 60)
    crashes = [i for i, e in enumerate(evs) if e["event"] == "coordinator_crashed"]
    assert len(crashes) == 2
    for crash in crashes:
        restart = next(i for i in range(crash, len(evs)) if evs[i]["event"] == "coordinator_started")
        before = [e["quorum_id"] for e in evs[:crash] if e["event"] == "quorum_formed"]
        after = [e["quorum_id"] for e in evs[restart:] if e["event"] == "quorum_formed"]
        assert after and min(after) > max(before)
    t = [e["t"] for e in evs if e.get("node") == "coordinator" and e["event"] == "step_committed"]
    assert t == sorted(t), "events of every incarnation share one time axis"


def _c(step: int, qid: int) -> CommitRecord:
    return CommitRecord(step, qid, ("w0",), 0.0, 0.0, 0.0, True)


def test_a_commit_no_worker_heard_of_is_superseded_by_the_next_incarnation():
    merged, superseded = merge_commits([[_c(0, 1), _c(1, 1), _c(2, 1)], [_c(2, 3), _c(3, 3)]])
    assert [(c.step, c.quorum_id) for c in merged] == [(0, 1), (1, 1), (2, 3), (3, 3)]
    assert [(c.step, c.quorum_id) for c in superseded] == [(2, 1)]
    merged, superseded = merge_commits([[_c(0, 1)], [], [_c(1, 4)]])  # an incarnation that committed nothing
    assert [c.step for c in merged] == [0, 1] and not superseded


def test_a_worker_frozen_across_a_coordinator_restart_never_makes_the_new_one_redo_steps(tmp_path):
    # w0 is SIGSTOPped at step 5 and thaws while the coordinator is down: it may reconnect first,
    # holding step 4 while its peers hold 11. The new incarnation starts above the durable
    # floor (RUN/coordinator_floor), so it heals w0 instead of committing steps 5.. again with it.
    plan = ('[[fault]]\nkind = "freeze"\nworker = 0\nat_step = 5\nfor_s = 3.0\n'
            '[[fault]]\nkind = "coordinator_kill"\nat_step = 12\nrestart_after_s = 2.5\n')
    s = train(tmp_path, plan, workers=3, steps=40, **PACE)
    assert_strict(s)
    run = tmp_path / "run"
    _each_step_committed_once(run, 40)
    evs = events(run)
    restart = [i for i, e in enumerate(evs) if e["event"] == "coordinator_started"][1]
    assert evs[restart]["cluster_step"] >= 10  # from the floor (steps 0..11 committed), before any Hello
    assert json.loads((run / "coordinator_floor").read_text())["step"] == 39
