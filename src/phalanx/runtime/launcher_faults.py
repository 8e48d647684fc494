"""Faults the launcher carries out itself, beside the FaultInjector: a coordinator crash followed by
a restart (``coordinator_kill``), and, under ``--network namespaces``, the network faults the kernel
acts out. ``split_plan`` hands the injector the plan without these, so no fault happens twice.

The coordinator crash is in-process: the embedded ``Coordinator`` object drops its listener, its
connections and all its state at once (``Coordinator.crash``), and after ``restart_after_s`` a
brand-new object listens on the same address. It is not a SIGKILL of a separate process, but the
workers cannot tell the difference: their connection drops, and the coordinator they reconnect to
knows nothing but what their ``Hello``s and the newest durable checkpoint tell it, and the
durable floor (``DurableFloor``) that the dead incarnation wrote before each new id or commit left it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from phalanx.faults.plan import NETWORK_KINDS, Fault, FaultKind, FaultPlan
from phalanx.membership.commit_log import CommitHistory, CommitRecord
from phalanx.membership.coordinator import Coordinator
from phalanx.faults.timeline import FaultRecord, FaultTimeline
from phalanx.runtime.netns import KernelFaults

DEFAULT_RESTART_AFTER_S = 1.0


def split_plan(plan: FaultPlan, kernel: KernelFaults | None) -> tuple[FaultPlan, tuple[Fault, ...], tuple[Fault, ...]]:
    """(plan for the FaultInjector, faults the kernel acts out, coordinator kills)."""
    kills = tuple(f for f in plan.faults if f.kind is FaultKind.COORDINATOR_KILL)
    in_kernel = tuple(f for f in plan.faults if kernel is not None and f not in kills and kernel.takes(f))
    rest = tuple(f for f in plan.faults if f not in kills and f not in in_kernel)
    return dataclasses.replace(plan, faults=rest), in_kernel, kills


def network_seams_env(injected: FaultPlan, remote_coordinator: str) -> dict[str, str]:
    """``PHALANX_NETWORK_FAULTS`` for the workers: "0" when nothing can send them a network fault
    (the plan's injected faults have no network kind, and the coordinator is this launcher's own),
    so they skip the network-fault seams, a queue and a task per control message; "1" otherwise
    (a remote coordinator may carry another launcher's faults). Kernel-acted faults (netns) do not
    go through the seams."""
    needed = bool(remote_coordinator) or any(f.kind in NETWORK_KINDS for f in injected.faults)
    return {"PHALANX_NETWORK_FAULTS": "1" if needed else "0"}


class CoordinatorHolder:
    """The live coordinator incarnation. The stall watch, progress, fault injector and the results
    read it through here, so they follow a restart. The commits of every incarnation are in the
    run's commit log (each incarnation appends to it), read back merged from ``history``."""

    def __init__(self, current: Coordinator, history: CommitHistory, shift_s: float = 0.0) -> None:
        self.current, self.history = current, history
        self._incarnations: list[tuple[Coordinator, float]] = [(current, shift_s)]

    def replace(self, new: Coordinator, shift_s: float) -> None:
        """``new`` takes over; ``shift_s``: its clock's start relative to the first incarnation's."""
        self.current = new
        self._incarnations.append((new, shift_s))

    def commits(self) -> CommitHistory:
        """Every incarnation's commits, merged (streamed from the log, not held in memory)."""
        return CommitHistory(self.history.path, self.history.first_incarnation)  # no length cached mid-run

    def superseded(self) -> list[CommitRecord]:
        return self.history.superseded()

    @property
    def steps_retried(self) -> int:
        return sum(coord.steps_retried for coord, _ in self._incarnations)


class LauncherFaults:
    """Runs coordinator kills and kernel faults on the run's FaultTimeline (which times detection
    and recovery from the coordinator's events, as for every other fault)."""

    def __init__(self, holder: CoordinatorHolder, restart: Callable[[], Awaitable[None]], timeline: FaultTimeline,
                 emit: Callable[..., None]) -> None:
        self.holder, self._restart, self.timeline, self._emit = holder, restart, timeline, emit
        self._kill_lock = asyncio.Lock()

    async def run(self, kernel: KernelFaults | None, kernel_faults: tuple[Fault, ...],
                  kills: tuple[Fault, ...]) -> None:
        jobs = [self._coordinator_kill(f) for f in kills]
        if kernel is not None and kernel_faults:
            jobs.append(kernel.run(kernel_faults, self.wait_for_trigger, self._record_kernel, self._ended))
        await asyncio.gather(*jobs)

    async def wait_for_trigger(self, f: Fault) -> None:
        await self.timeline.wait_until_due(f, lambda: self.holder.current.cluster_step + 1, time.monotonic,
                                           asyncio.sleep)

    def _record(self, f: Fault, targets: list[str]) -> FaultRecord:
        coord = self.holder.current
        single = f.worker if f.worker is not None else (int(targets[0][1:]) if len(targets) == 1 else None)
        rec = self.timeline.record(f, coord.cluster_step + 1, time.monotonic(), tuple(targets), single)
        coord.emit("fault_injected", kind=f.kind.value, worker=f"w{single}" if single is not None else None,
                   at_step=rec.at_step, description=f.describe(), targets=targets, where="launcher")
        return rec

    def _record_kernel(self, f: Fault, indices: list[int]) -> FaultRecord:
        return self._record(f, [f"w{i}" for i in indices])

    def _ended(self, rec: FaultRecord) -> None:
        rec.end(time.monotonic())
        if rec.kind == FaultKind.PARTITION.value:
            self.holder.current.emit("partition_healed", targets=list(rec.targets))

    async def _coordinator_kill(self, f: Fault) -> None:
        await self.wait_for_trigger(f)
        async with self._kill_lock:  # two kills never overlap: the second waits for the restart
            rec = self._record(f, [])
            old = self.holder.current
            restart_after_s = float(f.param("restart_after_s", DEFAULT_RESTART_AFTER_S))
            self._emit("coordinator_crashed", cluster_step=old.cluster_step, restart_after_s=restart_after_s)
            old.crash()
            await asyncio.sleep(restart_after_s)
            await self._restart()
            rec.restarted = True  # detected when the new incarnation admits its first worker
            self._ended(rec)


class DurableFloor:
    """``RUN/coordinator_floor``: the highest quorum id formed, and the highest step committed with
    its members, as JSON, replaced atomically before the assignment or commit leaves the process.
    A restarted coordinator starts above it (:meth:`Coordinator.raise_floor`)."""

    FILE = "coordinator_floor"

    def __init__(self, run_dir: Path) -> None:
        self.path, self.quorum_id, self.step = run_dir / self.FILE, 0, -1
        self.members: tuple[str, ...] = ()

    def raise_to(self, quorum_id: int, step: int = -1, members: tuple[str, ...] = ()) -> None:
        if quorum_id <= self.quorum_id and step <= self.step:
            return
        self.quorum_id = max(self.quorum_id, quorum_id)
        if step > self.step:
            self.step, self.members = step, members
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"quorum_id": self.quorum_id, "step": self.step, "members": list(self.members)}))
        os.replace(tmp, self.path)

    @classmethod
    def read(cls, run_dir: Path) -> tuple[int, int, tuple[str, ...]]:
        """(quorum id, committed step, its members); (0, -1, ()) when there is none or it cannot
        be read (it is data: parsed as JSON, checked, never executed)."""
        try:
            d = json.loads((run_dir / cls.FILE).read_text())
            members = d.get("members", [])
            if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
                raise ValueError("members must be a list of worker ids")
            return int(d["quorum_id"]), int(d["step"]), tuple(members)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return 0, -1, ()
