"""Faults a worker performs on itself when the launcher asks (via the coordinator).

SIGKILL and SIGSTOP come from outside (the supervisor); these need the process's cooperation:
- ``gil_hang``: the training thread holds the GIL for ``for_s`` (a C call through ctypes.PyDLL,
  which does not release it), so even the heartbeat thread stops;
- ``hang``: the training thread stalls inside its next step (after compute, before the all-reduce)
  without holding the GIL, so heartbeats go on and only the progress watch can tell;
- ``kill`` in phase ``allreduce``: SIGKILL to itself just after its all-reduce has started;
- ``straggler``: compute is stretched by ``factor`` (the extra time is slept after compute).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from typing import Any

from phalanx.core.messages import InjectFault

_libc = ctypes.PyDLL(None)  # PyDLL: calls keep holding the GIL


def hold_gil_for(seconds: float) -> None:
    _libc.usleep(ctypes.c_uint(int(seconds * 1_000_000)))


class InProcessFaults:
    def __init__(self, job: Any) -> None:
        self._job = job
        self._pending: InjectFault | None = None
        self._hang: InjectFault | None = None
        self._kill_at_step: int | None = None
        self._straggle_factor = 1.0
        self._straggle_until_s = 0.0
        self._lock = threading.Lock()

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, self._on_signal)

    def on_fault(self, fault: InjectFault) -> None:
        """Runs on the control thread."""
        if fault.kind == "hang":
            with self._lock:
                self._hang = fault  # taken by the training thread inside its next step
        elif fault.kind == "gil_hang":
            with self._lock:
                self._pending = fault
            # Delivered to the training thread itself, so it runs even if that thread is blocked.
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)
        elif fault.kind == "kill" and fault.phase == "allreduce":
            self._kill_at_step = fault.at_step
        elif fault.kind == "straggler":
            self._straggle_factor = max(1.0, fault.factor)
            self._straggle_until_s = time.monotonic() + (fault.for_s if fault.for_s > 0 else 1e9)

    def _on_signal(self, signum: int, frame: Any) -> None:
        with self._lock:
            fault, self._pending = self._pending, None
        if fault is None:
            return
        self._job._spans.event("fault_begin", kind=fault.kind, for_s=fault.for_s)
        hold_gil_for(fault.for_s)
        self._job._spans.event("fault_end", kind=fault.kind)

    def before_allreduce(self, step: Any, compute_s: float) -> None:
        with self._lock:
            hang, self._hang = self._hang, None
        if hang is not None:
            self._job._spans.event("fault_begin", kind="hang", for_s=hang.for_s, step=step.number)
            time.sleep(hang.for_s)  # in the quorum, short of the all-reduce its peers are waiting in
            self._job._spans.event("fault_end", kind="hang")
        if self._straggle_factor > 1.0 and time.monotonic() < self._straggle_until_s:
            time.sleep((self._straggle_factor - 1.0) * compute_s)
        at = self._kill_at_step
        if at is not None and step.number >= at:
            self._kill_at_step = None
            # Fire while the collective is in flight: peers are inside it, waiting for us.
            threading.Timer(0.003, os.kill, (os.getpid(), signal.SIGKILL)).start()
