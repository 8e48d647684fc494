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
from dataclasses import dataclass
from typing import Any

from phalanx.core.errors import FaultPlanError
from phalanx.core.messages import InjectFault
from phalanx.faults.plan import NETWORK_KINDS, Fault, FaultKind, FaultPlan
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
    targets: tuple[str, ...] = ()  # workers whose suspicion counts as detecting this fault

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "worker": self.worker, "at_step": self.at_step, "description": self.description,
                "detected_after_s": _r(self.detected_after_s), "recovered_after_s": _r(self.recovered_after_s),
                "ended_after_s": _r(self.ended_after_s), "targets": list(self.targets)}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


class FaultInjector:
    def __init__(self, plan: FaultPlan, coordinator: Coordinator, supervisor: Supervisor) -> None:
        self.plan, self.coord, self.sup = plan, coordinator, supervisor
        self.records: list[FaultRecord] = []
        self.kill_restart: dict[int, bool] = {}  # worker index -> restart it after the planned kill?
        self._first_commit_mono: float | None = None
        n = len(supervisor.workers)
        # Resolved up front, so a bad target in the plan fails before the run, with its line.
        self._network = {f.index: network_fault_messages(f, n, plan.path) for f in plan.faults
                         if f.kind in NETWORK_KINDS}

    def on_event(self, ev: dict[str, Any]) -> None:
        """Fed every coordinator event, to time detection and recovery."""
        now = time.monotonic()
        if ev["event"] == "step_committed" and self._first_commit_mono is None:
            self._first_commit_mono = now
        for r in self.records:
            if r.kind == FaultKind.JOIN.value:
                if r.recovered_after_s is None and ev["event"] == "step_committed" and \
                        set(r.targets) & set(ev.get("members", ())):
                    r.recovered_after_s = now - r.injected_mono
            elif r.detected_after_s is None and ev["event"] == "worker_suspected" and ev.get("worker") in r.targets:
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
            rec.ended_after_s = time.monotonic() - rec.injected_mono
        elif f.kind in (FaultKind.GIL_HANG, FaultKind.HANG, FaultKind.STRAGGLER):
            await self.coord.inject(f"w{f.worker}", InjectFault(kind=f.kind.value, for_s=f.for_s or 0.0,
                                                                factor=f.factor or 1.0))
            if f.for_s:
                await asyncio.sleep(f.for_s)
                rec.ended_after_s = time.monotonic() - rec.injected_mono
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
            rec.ended_after_s = time.monotonic() - rec.injected_mono
            self.coord.emit("partition_healed" if f.kind is FaultKind.PARTITION else "network_fault_lifted",
                            kind=f.kind.value)

    def _record(self, f: Fault, targets: tuple[str, ...] | None = None, worker: int | None = None) -> FaultRecord:
        worker = f.worker if worker is None else worker
        if targets is None:
            targets = (f"w{f.worker}",) if f.worker is not None else ()
        rec = FaultRecord(f.kind.value, worker, self.coord.cluster_step + 1, time.monotonic(), f.describe(),
                          targets=targets)
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


def network_fault_messages(f: Fault, num_workers: int, path: str = "<plan>") -> tuple[dict[str, InjectFault], tuple[str, ...]]:
    """Which worker gets which InjectFault for network fault ``f``, and the fault's targets.

    Partition: every worker gets the sides (the coordinator is with the first group, side 0), as
    in the simulator: ``isolate = N`` cuts one worker off, ``groups`` lists the sides, and with
    neither the workers above the middle are cut off. Link faults: untargeted, every link of every
    worker; ``workers`` (or ``worker``), every link of those workers, so their peers charge their
    links to them too; ``pair = [a, b]``, the one link between a and b.
    """
    def bad(problem: str) -> FaultPlanError:
        return FaultPlanError(path, f.line or None, f"fault #{f.index + 1} ({f.kind.value}): {problem}")

    def index(v: Any, key: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < num_workers:
            raise bad(f"'{key}' names worker {v!r}, which does not exist in a run of {num_workers} workers "
                      f"(0..{num_workers - 1})")
        return v

    names = [f"w{i}" for i in range(num_workers)]
    for_s = f.for_s or 0.0
    if f.kind is FaultKind.PARTITION:
        one_way = f.param("one_way", False)
        if not isinstance(one_way, bool):
            raise bad(f"'one_way' must be true or false, got {one_way!r}")
        sides: dict[str, int] = {}
        if f.param("isolate") is not None:
            sides[names[index(f.param("isolate"), "isolate")]] = 1
        elif f.param("groups") is not None:
            groups = f.param("groups")
            if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups) or len(groups) < 2:
                raise bad("'groups' must be a list of at least two lists of worker indices, e.g. [[0, 1], [2]]")
            for side, group in enumerate(groups):
                for v in group:
                    w = names[index(v, "groups")]
                    if w in sides:
                        raise bad(f"worker {v} is in two groups")
                    sides[w] = side  # the coordinator stays with the first group (side 0)
        else:
            sides = {names[i]: 1 for i in range(num_workers // 2 + 1, num_workers)}
        groups_by_side = [sorted((w for w, s in sides.items() if s == side), key=lambda w: int(w[1:]))
                          for side in range(max(sides.values(), default=0) + 1)]
        msg = InjectFault(kind="partition", for_s=for_s, groups=groups_by_side, one_way=one_way)
        targets = tuple(w for w in names if sides.get(w, 0) != 0)
        return {w: msg for w in names}, targets
    dist = f.param("distribution", "normal")
    if dist not in ("constant", "normal", "pareto"):
        raise bad(f"'distribution' must be \"constant\", \"normal\" or \"pareto\", got {dist!r}")
    base = {"kind": f.kind.value, "for_s": for_s, "mean_ms": float(f.param("mean_ms", 0.0)),
            "jitter_ms": float(f.param("jitter_ms", 0.0)), "distribution": dist,
            "probability": float(f.param("probability", 0.0)), "bytes_per_s": float(f.param("bytes_per_s", 0.0))}
    pair, chosen = f.param("pair"), f.param("workers")
    if pair is not None:
        if not isinstance(pair, list) or len(pair) != 2 or pair[0] == pair[1]:
            raise bad(f"'pair' must be two different worker indices, e.g. [0, 1], got {pair!r}")
        a, b = (names[index(v, "pair")] for v in pair)
        return {a: InjectFault(**base, peers=[b]), b: InjectFault(**base, peers=[a])}, (a, b)
    if chosen is None and f.worker is not None:
        chosen = [f.worker]
    if chosen is None:
        return {w: InjectFault(**base) for w in names}, tuple(names)
    if not isinstance(chosen, list) or not chosen:
        raise bad(f"'workers' must be a non-empty list of worker indices, got {chosen!r}")
    hit = sorted({names[index(v, "workers")] for v in chosen}, key=lambda w: int(w[1:]))
    out = {w: InjectFault(**base) if w in hit else InjectFault(**base, peers=hit) for w in names}
    return out, tuple(hit)
