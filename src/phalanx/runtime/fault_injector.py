"""Carries out a fault plan on a real run and measures detection and recovery for each fault.

Triggers: ``at_step`` (when that many steps have committed) or ``at_s`` (seconds since the first
commit). Detection: the coordinator's first suspicion of the target after injection. Recovery: the
first step committed after that detection (the cluster is making progress again).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from phalanx.core.messages import InjectFault
from phalanx.faults.plan import Fault, FaultKind, FaultPlan
from phalanx.membership.coordinator import Coordinator
from phalanx.runtime.supervisor import Supervisor


@dataclass
class FaultRecord:
    kind: str
    worker: int | None
    at_step: int
    injected_mono: float
    description: str
    detected_after_s: float | None = None
    recovered_after_s: float | None = None
    ended_after_s: float | None = None  # when a timed fault (freeze, hang) was lifted

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "worker": self.worker, "at_step": self.at_step, "description": self.description,
                "detected_after_s": _r(self.detected_after_s), "recovered_after_s": _r(self.recovered_after_s),
                "ended_after_s": _r(self.ended_after_s)}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


class FaultInjector:
    def __init__(self, plan: FaultPlan, coordinator: Coordinator, supervisor: Supervisor) -> None:
        self.plan, self.coord, self.sup = plan, coordinator, supervisor
        self.records: list[FaultRecord] = []
        self.kill_restart: dict[int, bool] = {}  # worker index -> restart it after the planned kill?
        self._first_commit_mono: float | None = None

    def on_event(self, ev: dict[str, Any]) -> None:
        """Fed every coordinator event, to time detection and recovery."""
        now = time.monotonic()
        if ev["event"] == "step_committed" and self._first_commit_mono is None:
            self._first_commit_mono = now
        for r in self.records:
            if r.detected_after_s is None and ev["event"] == "worker_suspected" and ev.get("worker") == f"w{r.worker}":
                r.detected_after_s = now - r.injected_mono
            elif r.detected_after_s is not None and r.recovered_after_s is None and ev["event"] == "step_committed":
                r.recovered_after_s = now - r.injected_mono

    async def run(self) -> None:
        await asyncio.gather(*(self._one(f) for f in self.plan.faults))

    async def _one(self, f: Fault) -> None:
        if f.kind is FaultKind.KILL and f.phase == "allreduce":
            await self._wait_connected(f.worker)
            await self.coord.inject(f"w{f.worker}", InjectFault(kind="kill", phase="allreduce", at_step=f.at_step or 0))
            await self._wait_trigger(f)
            self._record(f)
            self.kill_restart[f.worker or 0] = f.restart
            return
        await self._wait_trigger(f)
        rec = self._record(f)
        w = self.sup.workers[f.worker] if f.worker is not None else None
        if f.kind is FaultKind.KILL:
            assert w is not None
            self.kill_restart[w.index] = f.restart
            self.sup.kill(w)
        elif f.kind is FaultKind.FREEZE:
            assert w is not None and f.for_s is not None
            self.sup.freeze(w)
            await asyncio.sleep(f.for_s)
            self.sup.thaw(w)
            rec.ended_after_s = time.monotonic() - rec.injected_mono
        elif f.kind in (FaultKind.GIL_HANG, FaultKind.HANG, FaultKind.STRAGGLER):
            await self.coord.inject(f"w{f.worker}", InjectFault(kind=f.kind.value, for_s=f.for_s or 0.0,
                                                                factor=f.factor or 1.0))
            if f.for_s:
                await asyncio.sleep(f.for_s)
                rec.ended_after_s = time.monotonic() - rec.injected_mono
        else:
            raise AssertionError(f"fault kind {f.kind.value} reached the real injector unchecked")

    def _record(self, f: Fault) -> FaultRecord:
        rec = FaultRecord(f.kind.value, f.worker, self.coord.cluster_step + 1, time.monotonic(), f.describe())
        self.records.append(rec)
        self.coord.emit("fault_injected", kind=f.kind.value, worker=f"w{f.worker}" if f.worker is not None else None,
                        at_step=rec.at_step, description=f.describe())
        return rec

    async def _wait_connected(self, worker: int | None) -> None:
        while f"w{worker}" not in self.coord.sessions:
            await asyncio.sleep(0.05)

    async def _wait_trigger(self, f: Fault) -> None:
        while True:
            if f.at_step is not None and self.coord.cluster_step + 1 >= f.at_step:
                return
            if f.at_s is not None and self._first_commit_mono is not None and \
                    time.monotonic() - self._first_commit_mono >= f.at_s:
                return
            await asyncio.sleep(0.005)
