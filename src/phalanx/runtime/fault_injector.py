"""Carries out a fault plan on a real run and measures detection and recovery for each fault.

Triggers: ``at_step`` (when that many steps have committed) or ``at_s`` (seconds since the first
commit). Detection: the coordinator's first suspicion of a target after injection. Recovery: the
first step committed after that detection (the cluster is making progress again).

A ``join`` starts a worker the supervisor left out of ``start_all``; nothing is detected, and its
recovery is the first step committed with the joiner among the members.

Network faults (partition, latency, loss, bandwidth) are sent as ``InjectFault`` messages to every
worker they affect; each worker applies them at its own seams (``train.network_faults``). Their
targets are the workers cut off (partition) or degraded (link faults; all workers when untargeted).
"""

from __future__ import annotations

import asyncio
import time

from phalanx.core.messages import InjectFault
from phalanx.faults.plan import NETWORK_KINDS, Fault, FaultKind, FaultPlan
from phalanx.faults.targets import cut_off, link_scope, partition_sides, sides_as_groups
from phalanx.faults.timeline import FaultRecord, FaultTimeline
from phalanx.membership.coordinator import Coordinator
from phalanx.runtime.supervisor import Supervisor


class FaultInjector:
    def __init__(self, plan: FaultPlan, coordinator: Coordinator, supervisor: Supervisor,
                 timeline: FaultTimeline | None = None) -> None:
        self.plan, self.coord, self.sup = plan, coordinator, supervisor
        self.timeline = timeline or FaultTimeline()  # the launcher feeds it every coordinator event
        self.kill_restart: dict[int, bool] = {}  # worker index -> restart it after the planned kill?
        n = len(supervisor.workers)
        # Resolved up front, so a bad target in the plan fails before the run, with its line.
        plan.validate_workers(n)
        self._network = {f.index: network_fault_messages(f, n) for f in plan.faults if f.kind in NETWORK_KINDS}

    @property
    def records(self) -> list[FaultRecord]:
        return self.timeline.records

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
        if f.kind in NETWORK_KINDS:
            await self._network_fault(f)
            return
        await self._wait_trigger(f)
        w = self.sup.workers[f.worker] if f.worker is not None else None
        while w is not None and f.kind is not FaultKind.JOIN and w.waiting_to_join:
            await asyncio.sleep(0.005)  # the plan parser puts it after the join; keep that order here too
        rec = self._record(f)
        if f.kind is FaultKind.JOIN:
            assert w is not None
            self.sup.join(w)
        elif f.kind is FaultKind.KILL:
            assert w is not None
            self.kill_restart[w.index] = f.restart
            self.sup.kill(w)
        elif f.kind is FaultKind.FREEZE:
            assert w is not None and f.for_s is not None
            self.sup.freeze(w)
            await asyncio.sleep(f.for_s)
            self.sup.thaw(w)
            rec.end(time.monotonic())
        elif f.kind in (FaultKind.GIL_HANG, FaultKind.HANG, FaultKind.STRAGGLER):
            await self.coord.inject(f"w{f.worker}", InjectFault(kind=f.kind.value, for_s=f.for_s or 0.0,
                                                                factor=f.factor or 1.0))
            if f.for_s:
                await asyncio.sleep(f.for_s)
                rec.end(time.monotonic())
        else:
            raise AssertionError(f"fault kind {f.kind.value} reached the real injector unchecked")

    async def _network_fault(self, f: Fault) -> None:
        messages, targets = self._network[f.index]
        await self._wait_trigger(f)
        sole = int(targets[0][1:]) if len(targets) == 1 else f.worker
        rec = self._record(f, targets, worker=sole)
        sent = [w for w in messages if await self.coord.inject(w, messages[w])]  # in worker order
        self.coord.emit("network_fault_sent", kind=f.kind.value, workers=sent, targets=list(targets))
        if f.for_s:
            await asyncio.sleep(f.for_s)  # each worker lifts it on its own clock after for_s, too
            rec.end(time.monotonic())
            self.coord.emit("partition_healed" if f.kind is FaultKind.PARTITION else "network_fault_lifted",
                            kind=f.kind.value)

    def _record(self, f: Fault, targets: tuple[str, ...] | None = None, worker: int | None = None) -> FaultRecord:
        rec = self.timeline.record(f, self.coord.cluster_step + 1, time.monotonic(), targets or (), worker)
        self.coord.emit("fault_injected", kind=f.kind.value, worker=f"w{rec.worker}" if rec.worker is not None else None,
                        at_step=rec.at_step, description=f.describe())
        return rec

    async def _wait_connected(self, worker: int | None) -> None:
        while f"w{worker}" not in self.coord.sessions:
            await asyncio.sleep(0.05)

    async def _wait_trigger(self, f: Fault) -> None:
        await self.timeline.wait_until_due(f, lambda: self.coord.cluster_step + 1, time.monotonic, asyncio.sleep)


def network_fault_messages(f: Fault, num_workers: int) -> tuple[dict[str, InjectFault], tuple[str, ...]]:
    """Which worker gets which InjectFault for network fault ``f``, and the fault's targets (who
    it hits: faults/targets.py, the same rule the simulator uses). Each worker applies its message
    at its own seams (train/network_faults.py)."""
    names = [f"w{i}" for i in range(num_workers)]
    for_s = f.for_s or 0.0
    if f.kind is FaultKind.PARTITION:
        sides = partition_sides(f, num_workers)
        msg = InjectFault(kind="partition", for_s=for_s, groups=sides_as_groups(sides, num_workers),
                          one_way=bool(f.param("one_way", False)))
        return {w: msg for w in names}, cut_off(sides, num_workers)
    base = {"kind": f.kind.value, "for_s": for_s, "mean_ms": float(f.param("mean_ms", 0.0)),
            "jitter_ms": float(f.param("jitter_ms", 0.0)), "distribution": str(f.param("distribution", "normal")),
            "probability": float(f.param("probability", 0.0)), "bytes_per_s": float(f.param("bytes_per_s", 0.0))}
    scope = link_scope(f)
    if scope.pair:
        a, b = scope.pair
        return {a: InjectFault(**base, peers=[b]), b: InjectFault(**base, peers=[a])}, scope.pair
    if scope.everywhere:
        return {w: InjectFault(**base) for w in names}, tuple(names)
    hit = list(scope.workers)
    return {w: InjectFault(**base) if w in hit else InjectFault(**base, peers=hit) for w in names}, scope.workers
