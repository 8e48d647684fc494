"""The end of a job, in every mode: a worker that leaves ``job.steps()`` normally holds the final
state, and one that cannot get it gets FinalStateUnavailable, never a normal end. Real worker
processes, real SIGSTOP/SIGKILL; the bundled loop saves ``final_<worker>.safetensors`` after its
loop exactly as the README's quickstart does."""

import shutil
import threading
import time

import torch

from phalanx.checkpoint.durable import read_tensors_file
from phalanx.core.modes import ConsistencyMode, ModeConfig
from tests.integration.conftest import assert_strict, events, train

PACE = {"min_step_s": 0.08}
# w2 freezes 2 steps before the end of a 30-step job and wakes ~2.5 s after the others finished
FREEZE_ACROSS_END = '[[fault]]\nkind = "freeze"\nworker = 2\nat_step = 28\nfor_s = 2.5\n'


def _finals(run_dir):
    return {p.stem.removeprefix("final_"): read_tensors_file(p) for p in sorted(run_dir.glob("final_*.safetensors"))}


def _all_equal(finals):
    first = next(iter(finals.values()))
    return all(torch.equal(first[k], other[k]) for other in finals.values() for k in first)


def _caught_up(run_dir, worker):
    return [e for e in events(run_dir) if e["event"] == "caught_up_after_finish" and worker in e["members"]]


def test_strict_worker_frozen_across_the_end_heals_the_final_state_from_a_draining_peer(tmp_path):
    s = train(tmp_path, FREEZE_ACROSS_END, workers=3, steps=30, **PACE)
    assert_strict(s)
    run = tmp_path / "run"
    assert _caught_up(run, "w2"), "w2 woke after the last step and was caught up"
    healed = [e for e in events(run) if e["event"] == "worker_healed" and e["worker"] == "w2" and e["step"] == 30]
    assert healed and healed[0]["source"] in ("w0", "w1"), "it healed from a worker that was draining"
    assert set(s["reference_max_abs_diff_per_worker"]) == {"w0", "w1", "w2"}
    assert max(s["reference_max_abs_diff_per_worker"].values()) <= 1e-5


def test_available_worker_frozen_across_the_end_ends_with_the_same_model_as_its_peers(tmp_path):
    s = train(tmp_path, FREEZE_ACROSS_END, workers=3, steps=30, modes=ModeConfig(mode=ConsistencyMode.AVAILABLE),
              **PACE)
    assert s["ok"], s.get("reason")
    run = tmp_path / "run"
    assert _caught_up(run, "w2")
    finals = _finals(run)
    assert set(finals) == {"w0", "w1", "w2"} and _all_equal(finals)


def test_local_sgd_worker_frozen_across_the_end_adopts_the_final_merge(tmp_path):
    modes = ModeConfig(mode=ConsistencyMode.LOCAL_SGD, sync_every_steps=5, max_staleness_steps=10)
    plan = FREEZE_ACROSS_END.replace("at_step = 28", "at_step = 5")  # at_step counts merges: local step 25
    s = train(tmp_path, plan, workers=3, steps=30, modes=modes, **PACE)
    assert s["ok"], s.get("reason")
    run = tmp_path / "run"
    assert _caught_up(run, "w2")
    finals = _finals(run)
    assert set(finals) == {"w0", "w1", "w2"} and _all_equal(finals)


def test_worker_killed_in_the_last_step_and_restarted_ends_with_the_reference_model(tmp_path):
    # the last step is redone by the survivors; the restarted process arrives after the end and
    # heals from a draining peer (or restores the final checkpoint)
    plan = '[[fault]]\nkind = "kill"\nworker = 1\nat_step = 29\nphase = "allreduce"\nrestart = true\n'
    s = train(tmp_path, plan, workers=3, steps=30, **PACE)
    assert_strict(s)
    assert _caught_up(tmp_path / "run", "w1")
    assert set(s["reference_max_abs_diff_per_worker"]) == {"w0", "w1", "w2"}
    assert max(s["reference_max_abs_diff_per_worker"].values()) <= 1e-5


def test_worker_that_cannot_obtain_the_final_state_raises_instead_of_ending_normally(tmp_path):
    # w2 sleeps past the drain window (5 s) and the final checkpoint is lost meanwhile: nothing can
    # catch it up, so its job.steps() raises FinalStateUnavailable and it saves no model.
    run = tmp_path / "run"
    plan = '[[fault]]\nkind = "freeze"\nworker = 2\nat_step = 28\nfor_s = 8.0\n'
    stop = threading.Event()

    def lose_the_checkpoints() -> None:
        deadline = time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                done = [e for e in events(run) if e["event"] == "worker_finished" and e["completed"]]
            except (OSError, ValueError):
                done = []
            if len(done) >= 2:
                shutil.rmtree(run / "checkpoints", ignore_errors=True)
                return
            time.sleep(0.05)

    t = threading.Thread(target=lose_the_checkpoints, daemon=True)
    t.start()
    try:
        s = train(tmp_path, plan, workers=3, steps=30, **PACE)
    finally:
        stop.set()
        t.join(5)
    assert not s["ok"]
    assert set(_finals(run)) == {"w0", "w1"}, "w2 saved no stale model"
    log = (run / "workers" / "w2.log").read_text()
    assert "FinalStateUnavailable" in log and "final step is 29" in log, log[-2000:]
