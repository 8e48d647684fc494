"""The training benchmark's CPU a step: every worker process's mean after the warm-up, summed, plus
the launcher's (coordinator's) CPU per commit, sampled against the run's commit log."""

import os
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


def _burn(s: float) -> None:
    t0 = time.thread_time()
    while time.thread_time() - t0 < s:
        pass


def _named_burner(name: str, os_name: str, s: float) -> "threading.Thread":
    """A thread called ``name`` in Python and ``os_name`` by the OS (as torch names Gloo's threads)
    that burns ``s`` of CPU and then waits to be joined, so it is still in /proc when read."""
    import threading

    burned, done = threading.Event(), threading.Event()

    def run() -> None:
        if os_name:
            with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
                f.write(os_name)
        _burn(s)
        burned.set()
        done.wait(30)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.burned, t.done = burned, done  # type: ignore[attr-defined]
    return t


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_the_step_clock_splits_the_cpu_by_thread_kind_between_its_two_readings():
    from phalanx.bench.step_clock import StepClock
    from phalanx.runtime.worker_join import CONTROL_THREAD_NAME

    clock = StepClock()
    clock.mark()  # warm-up: not read by thread
    clock.mark(by_thread=True)
    threads = [_named_burner(CONTROL_THREAD_NAME, "", 0.2), _named_burner("g", "gloo_tcp_loop", 0.3),
               _named_burner("x", "", 0.1)]
    _burn(0.4)
    clock.mark()
    for t in threads:  # each thread's CPU counts, not the wall: wait until they have burned theirs
        assert t.burned.wait(30)
    clock.mark(by_thread=True)  # two steps since the first reading
    clock.mark()  # the end
    split = clock.intervals()["cpu_by_thread_s"]
    for t in threads:
        t.done.set()
        t.join()
    assert set(split) == {"training", "gloo", "control", "other"}
    assert split["training"] == pytest.approx(0.4 / 2, abs=0.03)
    assert split["control"] == pytest.approx(0.2 / 2, abs=0.03)
    assert split["gloo"] == pytest.approx(0.3 / 2, abs=0.03)
    assert split["other"] == pytest.approx(0.1 / 2, abs=0.03)


def test_one_reading_gives_no_split():
    from phalanx.bench.step_clock import StepClock

    clock = StepClock()
    clock.mark(by_thread=True)
    clock.mark()
    assert "cpu_by_thread_s" not in clock.intervals()


def test_the_jobs_split_sums_the_workers_and_adds_the_coordinator():
    from phalanx.bench.training import cpu_by_thread

    w = {"training": 0.020, "gloo": 0.002, "control": 0.001, "other": 0.0}
    assert cpu_by_thread([w, w], coordinator_s=0.003) == pytest.approx(
        {"training": 0.040, "gloo": 0.004, "control": 0.002, "other": 0.0, "coordinator": 0.003})
    assert cpu_by_thread([w, None]) == {}  # a partial sum would read as a cheaper job
    assert cpu_by_thread([w, {}]) == {}
