"""The training benchmark's CPU a step: every worker process's mean after the warm-up, summed, plus
the launcher's (coordinator's) CPU per commit, sampled against the run's commit log."""

import time

import pytest

from phalanx.bench.training import WARMUP_STEPS, LauncherCpu, cpu_per_step


def test_the_warm_up_is_left_out_and_the_workers_and_launcher_add_up():
    w0 = [1.0] * WARMUP_STEPS + [0.010, 0.012, 0.011, 0.300]  # the last interval holds the job's end
    w1 = [2.0] * WARMUP_STEPS + [0.020, 0.020, 0.250]
    assert cpu_per_step([w0, w1], launcher_s=0.005) == pytest.approx(0.011 + 0.020 + 0.005)
    assert cpu_per_step([[1.0] * WARMUP_STEPS + [0.3]]) == 0.0  # no step after the warm-up but the end: nothing


def test_the_launchers_cpu_is_per_commit_after_the_warm_up(tmp_path):
    log = tmp_path / "commits.jsonl"
    sampler = LauncherCpu(tmp_path)
    with open(log, "w") as f:
        f.write("{}\n" * WARMUP_STEPS)
        f.flush()
        time.sleep(0.3)  # the warm-up's end is sampled
        t0 = time.process_time()
        while time.process_time() - t0 < 0.1:  # 0.1 s of CPU over the next 10 commits
            pass
        f.write("{}\n" * 10)
        f.flush()
        time.sleep(0.3)
        t0 = time.process_time()
        while time.process_time() - t0 < 0.2:  # the job's end: CPU after the last commit is no step's
            pass
        time.sleep(0.3)
    per_commit = sampler.per_commit()
    assert 0.008 <= per_commit <= 0.02, per_commit  # ~0.01 s: 0.1 s over 10 commits (+ the sampler's own)


def test_no_commit_after_the_warm_up_gives_zero_not_a_division_by_zero(tmp_path):
    assert LauncherCpu(tmp_path).per_commit() == 0.0


def test_the_step_clock_splits_the_training_threads_cpu_from_the_processes():
    import threading

    from phalanx.bench.step_clock import StepClock

    def burn(s: float) -> None:
        t0 = time.thread_time()
        while time.thread_time() - t0 < s:
            pass

    clock = StepClock()
    clock.mark()
    other = threading.Thread(target=burn, args=(0.1,))  # another thread's CPU: the process's, not this thread's
    other.start()
    other.join()
    burn(0.05)
    clock.mark()
    clock.mark()  # the end: an empty interval
    timed = clock.intervals()
    assert [len(v) for v in timed.values()] == [2, 2, 2]
    assert timed["thread_cpu_s"][0] == pytest.approx(0.05, abs=0.02)
    assert timed["cpu_s"][0] == pytest.approx(0.15, abs=0.03)
    assert timed["step_s"][0] >= timed["cpu_s"][0] - 0.01  # one core at most busy at a time here
