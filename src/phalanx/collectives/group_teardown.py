"""What happens to a process group phalanx gives up on: its native threads go to the bottom of the
OS scheduler at once, and the group itself is dropped off the caller's thread.

Why the threads: a Gloo group whose peer was SIGKILLed can spin its ``gloo_tcp_loop`` thread at a
full core until its destructor has run, and that destructor may wait seconds for the group's
collectives to time out (session 19 measured drops of 3.0-3.2 s). The group's threads were started
by the control plane at its priority, while the user's training thread runs below it
(runtime/worker_join.py, ``PHALANX_COMPUTE_NICE``), so the spinning thread took the survivor's core
from its training thread: a survivor's retried step, normally 10-25 ms of compute, took up to
233 ms, and a kill's recovery up to 0.34 s (docs/BENCHMARKS.md, session 19). The threads are
found by name among those the group's constructor started (Linux ``/proc/self/task``; elsewhere
there is nothing to find and nothing is done).

Nothing here touches a group in use: only ``abandon`` (never waited on again) calls it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

GROUP_THREAD_NAMES = ("gloo", "pt_gloo")  # Gloo's I/O loop (gloo_tcp_loop), ProcessGroupGloo's work threads
ABANDONED_NICE = 19
_TASKS = "/proc/self/task"


def native_threads() -> dict[int, str]:
    """This process's threads: native id -> kernel name (empty where /proc is not Linux's)."""
    out: dict[int, str] = {}
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return out
    for t in tids:
        name = _thread_name(int(t))
        if name is not None:
            out[int(t)] = name
    return out


def threads_since(before: Mapping[int, str]) -> set[int]:
    """The threads started since ``before`` was taken (around a group's constructor). Their names
    are not read here: Gloo's work threads name themselves once running, maybe later than this."""
    return set(native_threads()) - set(before)


def lower_priority(threads: set[int], nice: int = ABANDONED_NICE) -> int:
    """Raise the nice value of each of ``threads`` that runs under a process group's thread name
    (``GROUP_THREAD_NAMES``) to ``nice`` (no privilege needed to go down); returns how many were
    changed. A thread that has ended, or that is not a group's (one the user started meanwhile),
    is left alone."""
    changed = 0
    for tid in threads:
        name = _thread_name(tid)
        if name is None or not name.startswith(GROUP_THREAD_NAMES):
            continue
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
        except OSError:
            continue  # ended meanwhile
    return changed


def _thread_name(tid: int) -> str | None:
    try:
        with open(f"{_TASKS}/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def drop_on_thread(obj: Any, name: str, wait_s: float = 10.0) -> None:
    """Take over the reference to ``obj`` (a process group) and drop it on a thread of its own once
    that thread holds the last one (callers let go of theirs as they return; up to ``wait_s``), so
    whatever its destructor waits for (a collective in flight) blocks no one else. Not a daemon:
    a script ending meanwhile died of SIGABRT after a normal end (the destructor half way here);
    once the main thread has ended, the drop is at once and the exit waits for it."""
    box = [obj]
    del obj

    def reap() -> None:
        deadline, main = time.monotonic() + wait_s, threading.main_thread()
        while sys.getrefcount(box[0]) > 2 and time.monotonic() < deadline and main.is_alive():  # box's and the call's
            time.sleep(0.02)
        box.clear()

    threading.Thread(target=reap, name=name, daemon=False).start()


class Graveyard:
    """Holds abandoned NCCL groups until their timeout has passed, then drops them off-thread."""

    def __init__(self, hold_s: float, max_groups: int = 64) -> None:
        self._hold_s = hold_s
        self._graves: deque[tuple[float, Any]] = deque(maxlen=max_groups)
        self._lock = threading.Lock()

    def bury(self, pg: Any) -> None:
        with self._lock:
            self._graves.append((time.monotonic() + self._hold_s, pg))
        self.sweep()

    def sweep(self) -> None:
        now = time.monotonic()
        expired = []
        with self._lock:
            while self._graves and self._graves[0][0] <= now:
                expired.append(self._graves.popleft()[1])
        if expired:
            threading.Thread(target=expired.clear, name="phalanx-pg-reaper", daemon=True).start()
