"""Faults the launcher carries out itself, beside the FaultInjector: a coordinator crash followed by
a restart (``coordinator_kill``), and, under ``--network namespaces``, the network faults the kernel
acts out. ``split_plan`` hands the injector the plan without these, so no fault happens twice.

The coordinator crash is in-process: the embedded ``Coordinator`` object drops its listener, its
connections and all its state at once (``Coordinator.crash``), and after ``restart_after_s`` a
brand-new object listens on the same address. It is not a SIGKILL of a separate process, but the
workers cannot tell the difference: their connection drops, and the coordinator they reconnect to
knows nothing but what their ``Hello``s and the newest durable checkpoint tell it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from phalanx.faults.plan import Fault, FaultKind, FaultPlan
from phalanx.membership.coordinator import CommitRecord, Coordinator
from phalanx.runtime.fault_injector import FaultRecord
from phalanx.runtime.netns import KernelFaults

DEFAULT_RESTART_AFTER_S = 1.0


def split_plan(plan: FaultPlan, kernel: KernelFaults | None) -> tuple[FaultPlan, tuple[Fault, ...], tuple[Fault, ...]]:
    """(plan for the FaultInjector, faults the kernel acts out, coordinator kills)."""
    kills = tuple(f for f in plan.faults if f.kind is FaultKind.COORDINATOR_KILL)
    in_kernel = tuple(f for f in plan.faults if kernel is not None and f not in kills and kernel.takes(f))
    rest = tuple(f for f in plan.faults if f not in kills and f not in in_kernel)
    return dataclasses.replace(plan, faults=rest), in_kernel, kills


def merge_commits(incarnations: list[list[CommitRecord]]) -> tuple[list[CommitRecord], list[CommitRecord]]:
    """One commit list over coordinator incarnations, and the records that were superseded.

    A crash can fall after the coordinator recorded a commit but before any worker heard of it:
    every worker then rolls that step back and the next incarnation commits it again. The later
    record is the one the workers acted on, so it replaces the earlier one.
    """
    merged: list[CommitRecord] = []
    superseded: list[CommitRecord] = []
    for commits in incarnations:
        if commits:
            first = commits[0].step
            superseded += [c for c in merged if c.step >= first]
            merged = [c for c in merged if c.step < first]
        merged += commits
    steps = [c.step for c in merged]
    assert steps == sorted(set(steps)), f"commits across coordinator incarnations go up by one: {steps[:20]}"
    return merged, superseded


class CoordinatorHolder:
    """The live coordinator incarnation. The stall watch, progress, fault injector and the results
    read it through here, so they follow a restart."""

    def __init__(self, current: Coordinator, shift_s: float = 0.0) -> None:
        self.current = current
        self._incarnations: list[tuple[Coordinator, float]] = [(current, shift_s)]

    def replace(self, new: Coordinator, shift_s: float) -> None:
        """``new`` takes over; ``shift_s``: its clock's start relative to the first incarnation's."""
        self.current = new
        self._incarnations.append((new, shift_s))

    def _merged(self) -> tuple[list[CommitRecord], list[CommitRecord]]:
        return merge_commits([[dataclasses.replace(c, committed_at_s=round(c.committed_at_s + shift_s, 6))
                               for c in coord.commits] for coord, shift_s in self._incarnations])

    def commits(self) -> list[CommitRecord]:
        return self._merged()[0]

    def superseded(self) -> list[CommitRecord]:
        return self._merged()[1]

    @property
    def steps_retried(self) -> int:
        return sum(coord.steps_retried for coord, _ in self._incarnations)


@dataclass
class _Tracked:
    record: FaultRecord
    targets: list[str]  # worker ids whose suspicion counts as detection ([] for a coordinator kill)
    restarted_mono: float | None = None


class LauncherFaults:
    """Runs coordinator kills and kernel faults; times detection and recovery like the injector.

    Detection of a kernel fault: the first suspicion of a worker it cut off or slowed. Detection
    of a coordinator kill: the first worker the restarted coordinator admits. Recovery: the first
    step committed after detection.
    """

    def __init__(self, holder: CoordinatorHolder, restart: Callable[[], Awaitable[None]],
                 emit: Callable[..., None]) -> None:
        self.holder, self._restart, self._emit = holder, restart, emit
        self._tracked: list[_Tracked] = []
        self._first_commit_mono: float | None = None
        self._kill_lock = asyncio.Lock()

    @property
    def records(self) -> list[FaultRecord]:
        return [t.record for t in self._tracked]

    def on_event(self, ev: dict[str, Any]) -> None:
        now = time.monotonic()
        name = ev["event"]
        if name == "step_committed" and self._first_commit_mono is None:
            self._first_commit_mono = now
        for t in self._tracked:
            r = t.record
            if r.detected_after_s is None:
                if (name == "worker_suspected" and ev.get("worker") in t.targets) or \
                        (name == "worker_joined" and t.restarted_mono is not None):
                    r.detected_after_s = now - r.injected_mono
            elif r.recovered_after_s is None and name == "step_committed":
                r.recovered_after_s = now - r.injected_mono

    async def run(self, kernel: KernelFaults | None, kernel_faults: tuple[Fault, ...],
                  kills: tuple[Fault, ...]) -> None:
        jobs = [self._coordinator_kill(f) for f in kills]
        if kernel is not None and kernel_faults:
            jobs.append(kernel.run(kernel_faults, self.wait_for_trigger, self._record_kernel, self._ended))
        await asyncio.gather(*jobs)

    async def wait_for_trigger(self, f: Fault) -> None:
        """``at_step``: that many steps committed; ``at_s``: seconds since the first commit."""
        while True:
            if f.at_step is not None and self.holder.current.cluster_step + 1 >= f.at_step:
                return
            if f.at_s is not None and self._first_commit_mono is not None and \
                    time.monotonic() - self._first_commit_mono >= f.at_s:
                return
            await asyncio.sleep(0.005)

    def _record(self, f: Fault, targets: list[str]) -> _Tracked:
        coord = self.holder.current
        single = f.worker if f.worker is not None else (int(targets[0][1:]) if len(targets) == 1 else None)
        rec = FaultRecord(kind=f.kind.value, worker=single, at_step=coord.cluster_step + 1,
                          injected_mono=time.monotonic(), description=f.describe(), targets=tuple(targets))
        tracked = _Tracked(rec, targets)
        self._tracked.append(tracked)
        coord.emit("fault_injected", kind=f.kind.value, worker=f"w{single}" if single is not None else None,
                   at_step=rec.at_step, description=f.describe(), targets=targets, where="launcher")
        return tracked

    def _record_kernel(self, f: Fault, indices: list[int]) -> _Tracked:
        return self._record(f, [f"w{i}" for i in indices])

    def _ended(self, tracked: _Tracked) -> None:
        tracked.record.ended_after_s = time.monotonic() - tracked.record.injected_mono
        if tracked.record.kind == FaultKind.PARTITION.value:
            self.holder.current.emit("partition_healed", targets=tracked.targets)

    async def _coordinator_kill(self, f: Fault) -> None:
        await self.wait_for_trigger(f)
        async with self._kill_lock:  # two kills never overlap: the second waits for the restart
            tracked = self._record(f, [])
            old = self.holder.current
            restart_after_s = float(f.param("restart_after_s", DEFAULT_RESTART_AFTER_S))
            self._emit("coordinator_crashed", cluster_step=old.cluster_step, restart_after_s=restart_after_s)
            old.crash()
            await asyncio.sleep(restart_after_s)
            await self._restart()
            tracked.restarted_mono = time.monotonic()
            self._ended(tracked)
