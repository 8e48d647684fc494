"""The clocks both benchmark workers (DDP's and phalanx's) read at every loop top and once after
the loop, so both sides are timed by the same code."""

from __future__ import annotations

import os
import threading
import time

from phalanx.runtime.worker_join import CONTROL_THREAD_NAME

WARMUP_STEPS = 5  # steps left out of every measure (the first quorum, the first buckets, caches)
# What each of a worker's threads is, by the name the OS has for it (torch names Gloo's) or by
# which thread it is: the one that marks is the training thread, phalanx.join()'s is the control one.
THREAD_KINDS = ("training", "gloo", "control", "other")
GLOO_THREAD_PREFIXES = ("gloo", "pt_gloo")


def cpu_by_thread_kind(training_tid: int) -> dict[str, float]:
    """This process's CPU seconds so far, per ``THREAD_KINDS``, read from ``/proc/self/task`` (each
    thread's utime + stime); {} where there is no such directory. Threads that have exited are not
    in it: take both readings while the threads being compared are alive."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    control = {t.native_id for t in threading.enumerate() if t.name == CONTROL_THREAD_NAME}
    tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
    out = dict.fromkeys(THREAD_KINDS, 0.0)
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        kind = ("training" if int(tid) == training_tid else "control" if int(tid) in control
                else "gloo" if name.startswith(GLOO_THREAD_PREFIXES) else "other")
        out[kind] += (int(fields[11]) + int(fields[12])) * tick_s  # utime, stime (proc(5): fields 14, 15)
    return out


class StepClock:
    """``mark()`` at each loop top and once after the loop; ``intervals()`` gives, per interval,
    the wall time (``step_s``), this process's CPU on every thread (``cpu_s``: training, control,
    Gloo's) and the calling (training) thread's alone (``thread_cpu_s``: forward, backward, the
    optimizer, and DDP's reducer hooks or phalanx's hooks and wait, which run on it). The last
    interval ends after the loop has exited (``training.cpu_per_step`` leaves it out).

    ``mark(by_thread=True)`` at two loop tops (the first measured step's and the last step's) also
    reads the CPU of every thread by kind (``cpu_by_thread_kind``, ~0.1 ms, so not at every mark);
    ``intervals()["cpu_by_thread_s"]`` is then the CPU a step between those two, per kind."""

    def __init__(self) -> None:
        self._marks: list[tuple[float, float, float]] = []
        self._by_thread: list[tuple[int, dict[str, float]]] = []  # (mark index, CPU by kind)
        self._tid = threading.get_native_id()

    def mark(self, by_thread: bool = False) -> None:
        self._marks.append((time.perf_counter(), time.process_time(), time.thread_time()))
        if by_thread:
            self._by_thread.append((len(self._marks) - 1, cpu_by_thread_kind(self._tid)))

    def intervals(self) -> dict[str, object]:
        pairs = list(zip(self._marks, self._marks[1:]))
        out: dict[str, object] = {key: [b[i] - a[i] for a, b in pairs]
                                  for i, key in enumerate(("step_s", "cpu_s", "thread_cpu_s"))}
        if len(self._by_thread) >= 2 and self._by_thread[0][1] and self._by_thread[-1][0] > self._by_thread[0][0]:
            (i0, a), (i1, b) = self._by_thread[0], self._by_thread[-1]
            out["cpu_by_thread_s"] = {k: (b[k] - a[k]) / (i1 - i0) for k in THREAD_KINDS}
        return out
