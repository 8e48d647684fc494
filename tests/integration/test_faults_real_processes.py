"""Real worker processes on loopback, real SIGKILL / SIGSTOP / held GIL. Each test ends with the
strict-equivalence and exactly-once checks against the single-process reference."""

import json
import os

from phalanx.train.host_memory import worker_hugepage_env
from tests.integration.conftest import assert_strict, events, train

# Steps are paced to >= 80 ms (emulated compute) so a restarted or thawed worker rejoins while the
# job still runs, even on a loaded 2-core CI machine; the model and the reference are unchanged.
PACE = {"min_step_s": 0.08}


def _suspected(run_dir, worker):
    return [e for e in events(run_dir) if e["event"] == "worker_suspected" and e["worker"] == worker]


def test_fault_free_run_matches_reference_with_no_false_suspicions(tmp_path):
    s = train(tmp_path, workers=3, steps=30)
    assert_strict(s)
    assert s["false_suspicions"] == 0 and s["steps_retried"] == 0


def test_sigkill_mid_allreduce_is_survived_and_the_restarted_worker_heals(tmp_path):
    plan = '[[fault]]\nkind = "kill"\nworker = 1\nat_step = 12\nphase = "allreduce"\nrestart = true\n'
    s = train(tmp_path, plan, workers=3, steps=70, **PACE)
    assert_strict(s)
    # no network fault in the plan: the workers ran without the network-fault seams
    seams = [json.loads(x) for x in (tmp_path / "run" / "workers" / "w0.jsonl").read_text().splitlines()
             if '"network_seams"' in x]
    assert seams and seams[0]["detail"].startswith("off")
    # the launcher put each worker's heap on huge pages where this machine has them, so a killed
    # worker's connections close sooner (train/host_memory.py)
    memory = [json.loads(x) for x in (tmp_path / "run" / "workers" / "w0.jsonl").read_text().splitlines()
              if '"host_memory"' in x]
    assert memory and memory[0]["huge_pages"] == bool(worker_hugepage_env(os.environ)[0])
    f = s["faults"][0]
    assert f["detected_after_s"] is not None and f["recovered_after_s"] is not None
    evs = events(tmp_path / "run")
    [exited] = [e for e in evs if e["event"] == "worker_exited" and e["worker"] == "w1" and e["exit_code"] == -9]
    [restarted] = [e for e in evs if e["event"] == "worker_restarted" and e["worker"] == "w1"]
    # the replacement started once the two survivors had committed without it (the restart hold),
    # not while they redid the step, and within the hold's bound
    recovered = [e for e in evs if e["event"] == "step_committed" and e["mono"] > exited["mono"]]
    assert recovered and "w1" not in recovered[0]["members"]
    assert recovered[0]["mono"] <= restarted["mono"] and 0 < restarted["held_s"] < 1.0  # 0.5 s + the poll's lateness
    assert any(e["event"] == "worker_healed" and e["worker"] == "w1" for e in evs)


def test_sigstop_frozen_worker_leaves_the_quorum_and_rejoins_after_thaw(tmp_path):
    plan = '[[fault]]\nkind = "freeze"\nworker = 2\nat_step = 10\nfor_s = 2.0\n'
    s = train(tmp_path, plan, workers=3, steps=60, **PACE)
    assert_strict(s)
    assert _suspected(tmp_path / "run", "w2")
    assert s["faults"][0]["detected_after_s"] < 1.5


def test_worker_holding_the_gil_is_detected_by_its_silent_heartbeats(tmp_path):
    plan = '[[fault]]\nkind = "gil_hang"\nworker = 1\nat_step = 10\nfor_s = 2.0\n'
    s = train(tmp_path, plan, workers=3, steps=60, **PACE)
    assert_strict(s)
    sus = _suspected(tmp_path / "run", "w1")
    assert sus and sus[0]["reason"].startswith("no heartbeat")


def test_two_worker_job_survives_a_hang_of_one_worker(tmp_path):
    # torchft blocks here (and exits at its quorum timeout); phalanx evicts the hung worker
    plan = '[[fault]]\nkind = "hang"\nworker = 1\nat_step = 8\nfor_s = 4.0\n'
    s = train(tmp_path, plan, workers=2, steps=60, **PACE)
    assert_strict(s)
    sus = _suspected(tmp_path / "run", "w1")
    assert sus and sus[0]["reason"].startswith("no step progress")
    solo = [e for e in events(tmp_path / "run") if e["event"] == "step_committed" and e["members"] == ["w0"]]
    assert solo, "the healthy worker kept committing on its own"


def test_kill_every_worker_then_resume_reaches_the_same_parameters(tmp_path):
    plan = "".join(f'[[fault]]\nkind = "kill"\nworker = {w}\nat_step = 25\nrestart = false\n' for w in range(3))
    first = train(tmp_path, plan, workers=3, steps=40, checkpoint_every_steps=10, name="job")
    assert not first["ok"]
    assert 20 <= first["steps_committed"] < 40
    resumed = train(tmp_path, workers=3, steps=40, checkpoint_every_steps=10, name="job", resume=True)
    assert_strict(resumed)


def test_worker_restarted_after_the_job_finished_catches_up_to_the_final_state(tmp_path):
    # The job ends (fast, unpaced steps) long before the restarted worker is back: it heals from a
    # peer still draining (or restores the final checkpoint) instead of stalling, and ends with
    # the same parameters as the others.
    plan = '[[fault]]\nkind = "kill"\nworker = 2\nat_step = 5\nrestart = true\n'
    s = train(tmp_path, plan, workers=3, steps=30, checkpoint_every_steps=100)
    assert_strict(s)
    evs = events(tmp_path / "run")
    assert any(e["event"] == "caught_up_after_finish" and "w2" in e["members"] for e in evs)
    assert "w2" in s["reference_max_abs_diff_per_worker"]
    assert not any(e["event"] == "step_aborted" and e["step"] >= 30 for e in evs)
