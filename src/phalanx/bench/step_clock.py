"""The clocks both benchmark workers (DDP's and phalanx's) read at every loop top and once after
the loop, so both sides are timed by the same code."""

from __future__ import annotations

import time


class StepClock:
    """``mark()`` at each loop top and once after the loop; ``intervals()`` gives, per interval,
    the wall time (``step_s``), this process's CPU on every thread (``cpu_s``: training, control,
    Gloo's) and the calling (training) thread's alone (``thread_cpu_s``: forward, backward, the
    optimizer, and DDP's reducer hooks or phalanx's hooks and wait, which run on it). The last
    interval ends after the loop has exited (``training.cpu_per_step`` leaves it out)."""

    def __init__(self) -> None:
        self._marks: list[tuple[float, float, float]] = []

    def mark(self) -> None:
        self._marks.append((time.perf_counter(), time.process_time(), time.thread_time()))

    def intervals(self) -> dict[str, list[float]]:
        pairs = list(zip(self._marks, self._marks[1:]))
        return {key: [b[i] - a[i] for a, b in pairs] for i, key in enumerate(("step_s", "cpu_s", "thread_cpu_s"))}
