"""Worker processes: start, watch, signal and restart them (real processes, real signals)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# index -> (argv to run, extra env): e.g. prefix `ip netns exec NS`, which execs, so the pid we
# signal is the worker's own
Wrap = Callable[[int, list[str]], tuple[list[str], dict[str, str]]]


@dataclass
class WorkerProcess:
    index: int
    worker_id: str
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    exit_codes: list[int] = field(default_factory=list)
    finished: bool = False  # exited 0
    departed: bool = False  # the fault plan killed it for good (`restart = false`): gone, not failed
    frozen: bool = False
    reported: bool = False  # its current process's exit was already handled
    waiting_to_join: bool = False  # a `join` fault starts it later: not started, so neither exited nor finished

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else -1

    @property
    def alive(self) -> bool:
        # An exit that poll() has not reported yet still counts as alive, so the launcher never
        # decides "everyone exited" before it has seen (and possibly restarted) that exit.
        return self.proc is not None and (self.proc.poll() is None or not self.reported)


class Supervisor:
    def __init__(self, argv: list[str], env: dict[str, str], run_dir: Path, count: int,
                 restart_failed: bool, max_restarts: int = 5, id_prefix: str = "w", wrap: Wrap | None = None,
                 joiners: frozenset[int] = frozenset()) -> None:
        self.argv, self.env, self.run_dir = argv, env, run_dir
        self.wrap = wrap
        self.restart_failed, self.max_restarts = restart_failed, max_restarts
        self.workers = [WorkerProcess(i, f"{id_prefix}{i}", waiting_to_join=i in joiners) for i in range(count)]
        (run_dir / "workers").mkdir(parents=True, exist_ok=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._woken: asyncio.Event | None = None  # set by a worker's exit, once watch_exits() ran
        self._pidfds: dict[int, int] = {}  # worker index -> a pidfd of its current process, while watched

    # ---- exits as events: the launcher sleeps until one, not polling every 50 ms ----
    def watch_exits(self) -> bool:
        """From now on a started worker's exit wakes :meth:`wait` at once: a pidfd (Linux 5.3+) for
        each process, read by the running event loop. False where there is none: then nothing
        wakes :meth:`wait` but its timeout, and the caller polls."""
        if not hasattr(os, "pidfd_open"):
            return False
        self._loop, self._woken = asyncio.get_running_loop(), asyncio.Event()
        for w in self.workers:
            if w.proc is not None and not w.reported:
                self._watch(w)
        return True

    async def wait(self, timeout_s: float) -> None:
        """Until a watched worker exits, :meth:`wake` is called, or ``timeout_s`` passes."""
        if self._woken is None:
            await asyncio.sleep(timeout_s)
            return
        try:
            await asyncio.wait_for(self._woken.wait(), timeout_s)
        except TimeoutError:
            pass
        self._woken.clear()  # an exit after this is seen by the caller's poll() or wakes the next wait

    def wake(self) -> None:
        if self._woken is not None:
            self._woken.set()

    def _watch(self, w: WorkerProcess) -> None:
        self._unwatch(w)
        try:
            fd = os.pidfd_open(w.pid)
        except OSError:  # already reaped, or no pidfds here: the caller's timeout still polls
            return
        self._pidfds[w.index] = fd
        self._loop.add_reader(fd, self.wake)

    def _unwatch(self, w: WorkerProcess) -> None:
        fd = self._pidfds.pop(w.index, None)
        if fd is not None:
            self._loop.remove_reader(fd)
            os.close(fd)

    def start_all(self) -> None:
        """Every worker but those a `join` fault starts later (:meth:`join`)."""
        for w in self.workers:
            if not w.waiting_to_join:
                self.start(w)

    def join(self, w: WorkerProcess) -> None:
        """Start a worker that was not there at the start: a fresh process, it heals from a peer."""
        assert w.waiting_to_join and w.proc is None, f"{w.worker_id} joins once, and only if it was never started"
        w.waiting_to_join = False
        self.start(w)

    def not_joined(self) -> list[WorkerProcess]:
        return [w for w in self.workers if w.waiting_to_join]

    def start(self, w: WorkerProcess) -> None:
        env = {**self.env, "PHALANX_WORKER_ID": w.worker_id, "PHALANX_WORKER_INDEX": str(w.index),
               "OMP_NUM_THREADS": self.env.get("OMP_NUM_THREADS", "1")}
        argv = self.argv
        if self.wrap is not None:
            argv, extra = self.wrap(w.index, self.argv)
            env.update(extra)
        log = open(self.run_dir / "workers" / f"{w.worker_id}.log", "ab")
        w.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
                                  start_new_session=True)  # its own group: our Ctrl-C is ours to forward
        log.close()
        w.frozen, w.reported = False, False
        if self._woken is not None:
            self._watch(w)

    def poll(self) -> list[tuple[WorkerProcess, int]]:
        """Return workers that exited since the last poll, with their exit codes."""
        exited = []
        for w in self.workers:
            if w.proc is not None and not w.reported:
                code = w.proc.poll()
                if code is not None:
                    w.reported = True
                    self._unwatch(w)
                    w.exit_codes.append(code)
                    w.finished = code == 0
                    exited.append((w, code))
        return exited

    def may_restart(self, w: WorkerProcess, fault_restart: bool) -> bool:
        return (self.restart_failed or fault_restart) and w.restarts < self.max_restarts

    def restart(self, w: WorkerProcess) -> None:
        w.restarts += 1
        self.start(w)

    def kill(self, w: WorkerProcess) -> None:
        if w.alive:
            os.kill(w.pid, signal.SIGKILL)

    def freeze(self, w: WorkerProcess) -> None:
        if w.alive:
            os.kill(w.pid, signal.SIGSTOP)
            w.frozen = True

    def thaw(self, w: WorkerProcess) -> None:
        if w.alive:
            os.kill(w.pid, signal.SIGCONT)
        w.frozen = False

    def stop_all(self, grace_s: float = 3.0) -> None:
        for w in self.workers:
            self._unwatch(w)
            if w.alive:
                if w.frozen:
                    self.thaw(w)
                w.proc.terminate()  # type: ignore[union-attr]
        deadline = time.monotonic() + grace_s
        for w in self.workers:
            if w.proc is not None:
                try:
                    w.proc.wait(timeout=max(0.05, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    w.proc.kill()
                    w.proc.wait()

    def all_finished(self) -> bool:
        """Every started worker exited 0 or was killed for good by the plan, and at least one
        finished (one still waiting to join has not finished: see not_joined)."""
        started = [w for w in self.workers if not w.waiting_to_join]
        return any(w.finished for w in started) and all(w.finished or w.departed for w in started)

    def any_running(self) -> bool:
        return any(w.alive for w in self.workers)


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL this worker when the launcher dies, however it dies (a
    SIGKILLed launcher runs no cleanup, and its workers must not live on as orphans holding ports,
    namespaces and GPU memory). Linux only; elsewhere a no-op."""
    import ctypes
    import signal as _signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, _signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
