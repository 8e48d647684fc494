"""A simulated cluster: the production Coordinator and N SimWorkers on a SimNetwork, in virtual
time, driven through a fault plan, with the protocol invariants checked as events happen.

    result = Cluster(workers=1024, steps=100, seed=7, plan=plan).run()
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from phalanx.faults.plan import EMPTY_PLAN, Fault, FaultKind, FaultPlan
from phalanx.membership.coordinator import Coordinator, CoordinatorConfig
from phalanx.membership.failure_detector import DetectorConfig
from phalanx.membership.quorum import QuorumConfig
from phalanx.sim.host import SimHost
from phalanx.sim.loop import run_virtual
from phalanx.sim.network import LinkModel, SimNetwork
from phalanx.sim.process_group import CollectiveModel, SimProcessGroupFactory
from phalanx.sim.worker import SimWorker, digest_lines
from phalanx.sim.workload import RegressionData, SimModelConfig, reference_params
from phalanx.train import sharding


@dataclass
class SimResult:
    ok: bool
    reason: str
    violations: list[str]
    summary: dict[str, Any]
    commits: list[dict[str, Any]]
    events: list[dict[str, Any]]
    spans: list[dict[str, Any]]
    digest: str


@dataclass
class _FaultRecord:
    fault: Fault
    injected_s: float
    at_step: int
    targets: set[str]
    detected_after_s: float | None = None
    recovered_after_s: float | None = None
    ended_after_s: float | None = None


@dataclass
class Cluster:
    workers: int
    steps: int
    seed: int = 0
    plan: FaultPlan = EMPTY_PLAN
    model_cfg: SimModelConfig = field(default_factory=SimModelConfig)
    link: LinkModel = field(default_factory=LinkModel)
    racks: int = 1
    collective: CollectiveModel = field(default_factory=CollectiveModel)
    step_compute_s: float = 0.05  # compute of one step at the full world's share
    compute_jitter: float = 0.02  # relative, per worker per step
    restart_delay_s: float = 2.0  # a killed worker's process restarts after this long
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    collective_timeout_s: float = 5.0
    max_virtual_s: float = 3600.0
    record_spans: bool | None = None  # default: only for small clusters

    def __post_init__(self) -> None:
        self.plan.validate_workers(self.workers)
        self.plan.require_supported("sim")
        if self.model_cfg.global_batch_size < self.workers:
            self.model_cfg = SimModelConfig(**{**vars(self.model_cfg), "global_batch_size": self.workers * 2,
                                               "dataset_size": max(self.model_cfg.dataset_size, self.workers * 16)})
        if self.record_spans is None:
            self.record_spans = self.workers <= 64

    # ---- observers used by workers and the coordinator ----
    def span(self, worker: str, name: str, start_s: float, **fields: Any) -> None:
        if self.record_spans:
            now = self._loop.time()
            self.spans.append({"mono": round(start_s, 9), "dur": round(now - start_s, 9), "node": worker,
                               "span": name, **fields})

    def compute_s(self, w: SimWorker, samples: int) -> float:
        per_sample_s = self.step_compute_s * self.workers / self.model_cfg.global_batch_size
        jitter = 1.0 + self.compute_jitter * (self._rng.random() * 2 - 1)
        return per_sample_s * samples * jitter * w.straggle_factor

    def on_event(self, ev: dict[str, Any]) -> None:
        ev["mono"] = ev["t"]
        self.events.append(ev)
        kind = ev["event"]
        if kind == "quorum_formed":
            qid, members = ev["quorum_id"], tuple(ev["members"])
            prev = self._quorum_members.setdefault(qid, members)
            if prev != members:
                self._violate(f"quorum id {qid} was used by two different member sets")
            if qid < self._last_qid:
                self._violate(f"quorum id went back from {self._last_qid} to {qid}")
            self._last_qid = max(self._last_qid, qid)
        elif kind == "step_committed":
            qid, members = ev["quorum_id"], tuple(ev["members"])
            if self._quorum_members.setdefault(qid, members) != members:
                self._violate(f"quorum id {qid} was used by two different member sets")
            self._committed[ev["step"]] = (qid, set(members))
        for r in self._records:
            if r.detected_after_s is None and kind == "worker_suspected" and ev.get("worker") in r.targets:
                r.detected_after_s = self._loop.time() - r.injected_s
            elif r.detected_after_s is not None and r.recovered_after_s is None and kind == "step_committed":
                r.recovered_after_s = self._loop.time() - r.injected_s

    def on_worker_commit(self, w: SimWorker, step: int, quorum_id: int, digest: str) -> None:
        rec = self._committed.get(step)
        if rec is None or rec[0] != quorum_id or w.worker_id not in rec[1]:
            self._violate(f"{w.worker_id} committed step {step} in quorum {quorum_id} outside a committed quorum")
        first = self._step_digest.setdefault(step, digest)
        if first != digest:
            self._violate(f"{w.worker_id} holds different parameters after step {step} than its peers")

    def _violate(self, what: str) -> None:
        t = self._loop.time()
        if len(self.violations) < 50:
            self.violations.append(f"t={t:.6f}s: {what}")

    # ---- running ----
    def run(self) -> SimResult:
        t0 = time.perf_counter()
        self.events: list[dict[str, Any]] = []
        self.spans: list[dict[str, Any]] = []
        self.violations: list[str] = []
        self._records: list[_FaultRecord] = []
        self._quorum_members: dict[int, tuple[str, ...]] = {}
        self._committed: dict[int, tuple[int, set[str]]] = {}
        self._step_digest: dict[int, str] = {}
        self._last_qid = 0
        (ok, reason), loop = run_virtual(self._main(), self.seed)
        wall_s = time.perf_counter() - t0
        return self._result(ok, reason, loop.time(), wall_s, loop.timer_events)

    async def _main(self) -> tuple[bool, str]:
        self._loop = asyncio.get_running_loop()
        self._rng = random.Random(f"compute:{self.seed}")
        self.net = SimNetwork(self.seed, self.link, self.racks)
        self.net.install_task_factory(self._loop)
        self.pgf = SimProcessGroupFactory(self.net, self.collective)
        self.data = RegressionData(self.model_cfg)
        cnode = self.net.add_node("coordinator")
        ccfg = CoordinatorConfig(detector=self.detector, quorum=QuorumConfig(min_workers=1, expected_workers=self.workers),
                                 collective_timeout_s=self.collective_timeout_s, run_id=f"sim-{self.seed}")
        self.coord = Coordinator(SimHost(self.net, cnode, self.seed), ccfg, "sim-store", self.on_event)
        self.coordinator_address = await self.net.spawn(cnode, self.coord.start("coordinator"), "start")
        self.sim_workers = [SimWorker(self, i) for i in range(self.workers)]
        for w in self.sim_workers:
            w.start()
        faults = [asyncio.ensure_future(self._inject(f)) for f in self.plan.faults]
        try:
            return await self._wait_done()
        finally:
            for f in faults:
                f.cancel()
            await self.coord.stop("simulation finished")

    async def _wait_done(self) -> tuple[bool, str]:
        last_progress, last_step = self._loop.time(), -1
        while True:
            await asyncio.sleep(0.25)
            now = self._loop.time()
            if all(w.finished or w.gone for w in self.sim_workers) and not self._pending_restarts():
                return True, "all workers finished"
            if self.coord.cluster_step != last_step:
                last_step, last_progress = self.coord.cluster_step, now
            if now - last_progress > 120.0:
                return False, f"no step committed for 120 virtual s (last step {last_step}): {self.coord.stall_reason}"
            if now > self.max_virtual_s:
                return False, f"passed the virtual time limit of {self.max_virtual_s:.0f} s"

    def _pending_restarts(self) -> bool:
        return any(not w.node.alive and not w.gone for w in self.sim_workers)

    # ---- faults ----
    async def _trigger(self, f: Fault) -> None:
        while True:
            if f.at_step is not None and self.coord.cluster_step + 1 >= f.at_step:
                return
            if f.at_s is not None and self._loop.time() >= f.at_s:
                return
            await asyncio.sleep(0.01)

    async def _inject(self, f: Fault) -> None:
        await self._trigger(f)
        now = self._loop.time()
        w = self.sim_workers[f.worker] if f.worker is not None else None
        targets = {w.worker_id} if w else set()
        rec = _FaultRecord(f, now, self.coord.cluster_step + 1, targets)
        self._records.append(rec)
        self.coord.emit("fault_injected", kind=f.kind.value, worker=w.worker_id if w else None,
                        at_step=rec.at_step, description=f.describe())
        k = f.kind
        if k is FaultKind.KILL:
            assert w is not None
            w.crash()
            if not f.restart:
                w.gone = True
                return
            await asyncio.sleep(self.restart_delay_s)
            w.restarts += 1
            w.start()
            return
        if k in (FaultKind.FREEZE, FaultKind.GIL_HANG):  # both silence the heartbeats
            assert w is not None and f.for_s
            w.node.frozen_until_s = now + f.for_s
        elif k is FaultKind.HANG:
            assert w is not None and f.for_s
            w.hang_s = f.for_s
        elif k is FaultKind.STRAGGLER:
            assert w is not None and f.factor
            w.straggle_factor = f.factor
        elif k is FaultKind.PARTITION:
            rec.targets = self._partition(f)
        elif k in (FaultKind.LATENCY, FaultKind.LOSS, FaultKind.BANDWIDTH):
            saved = (self.net.link.latency_s, self.net.link.jitter_s, self.net.link.distribution,
                     self.net.link.loss, self.net.link.bandwidth_bytes_per_s)
            self._degrade(f)
        else:
            raise AssertionError(f"fault kind {k.value} reached the simulator unchecked")
        if f.for_s:
            await asyncio.sleep(f.for_s)
            rec.ended_after_s = self._loop.time() - rec.injected_s
            if k is FaultKind.STRAGGLER and w is not None:
                w.straggle_factor = 1.0
            elif k is FaultKind.PARTITION:
                self.net.heal_partition()
                self.coord.emit("partition_healed")
            elif k in (FaultKind.LATENCY, FaultKind.LOSS, FaultKind.BANDWIDTH):
                link = self.net.link
                (link.latency_s, link.jitter_s, link.distribution, link.loss, link.bandwidth_bytes_per_s) = saved

    def _partition(self, f: Fault) -> set[str]:
        groups = f.param("groups")
        isolate = f.param("isolate")
        sides: dict[str, int] = {}
        if isolate is not None:
            sides[f"w{int(isolate)}"] = 1
        elif groups:
            for side, group in enumerate(groups):
                for i in group:
                    sides[f"w{int(i)}"] = side  # the coordinator stays with the first group (side 0)
        else:
            half = self.workers // 2  # default: a minority of the workers is cut off with nobody
            sides = {f"w{i}": 1 for i in range(half + 1, self.workers)}
        self.net.partition(sides, one_way=bool(f.param("one_way", False)))
        return {w for w, s in sides.items() if s != 0}

    def _degrade(self, f: Fault) -> None:
        link = self.net.link
        if f.kind is FaultKind.LATENCY:
            link.latency_s = float(f.param("mean_ms", 0.0)) / 1000
            link.jitter_s = float(f.param("jitter_ms", 0.0)) / 1000
            link.distribution = str(f.param("distribution", "normal"))
        elif f.kind is FaultKind.LOSS:
            link.loss = float(f.param("probability", 0.0))
        else:
            link.bandwidth_bytes_per_s = float(f.param("bytes_per_s", link.bandwidth_bytes_per_s))

    # ---- results ----
    def _result(self, ok: bool, reason: str, virtual_s: float, wall_s: float, timer_events: int) -> SimResult:
        commits = [{"step": c.step, "quorum_id": c.quorum_id, "members": list(c.members), "loss": c.loss,
                    "step_s": c.step_s, "committed_at_s": c.committed_at_s, "samples_covered_once": c.covered_once}
                   for c in self.coord.commits]
        self._check_end(commits)
        ref_w, ref_losses = reference_params(self.model_cfg, self.steps)
        finals = [w for w in self.sim_workers if w.completed]
        diff = max((float(np.max(np.abs(w.w - ref_w))) for w in finals), default=None)
        if diff is not None and diff > 1e-9:
            self._violate(f"final parameters differ from the single-process reference by {diff:.3e}")
        lines = [json.dumps(e, sort_keys=True, default=str) for e in self.events]
        faults = [{"kind": r.fault.kind.value, "worker": r.fault.worker, "at_step": r.at_step,
                   "description": r.fault.describe(), "detected_after_s": _r(r.detected_after_s),
                   "recovered_after_s": _r(r.recovered_after_s), "ended_after_s": _r(r.ended_after_s)}
                  for r in self._records]
        step_times = [c["step_s"] for c in commits[1:]]
        summary = {
            "ok": ok and not self.violations, "reason": reason if not self.violations else self.violations[0],
            "simulated": True, "seed": self.seed, "workers": self.workers, "steps": self.steps,
            "steps_committed": len(commits), "steps_retried": self.coord.steps_retried, "faults": faults,
            "samples_exactly_once": _exactly_once(commits, self.steps, self.model_cfg),
            "final_loss": commits[-1]["loss"] if commits else None, "reference_final_loss": ref_losses[-1],
            "reference_max_abs_diff": diff, "virtual_s": round(virtual_s, 6), "wall_s": round(wall_s, 3),
            "goodput_steps_per_virtual_s": round(len(commits) / virtual_s, 4) if virtual_s else None,
            "median_step_s": round(float(np.median(step_times)), 6) if step_times else None,
            "timer_events": timer_events, "violations": self.violations,
            "control_plane": {"bytes_sent": self.net.bytes_sent, "frames_sent": self.net.messages_sent},
            "collectives": self.pgf.collectives,
        }
        return SimResult(summary["ok"], summary["reason"], self.violations, summary, commits, self.events,
                         self.spans, digest_lines(lines))

    def _check_end(self, commits: list[dict[str, Any]]) -> None:
        steps = [c["step"] for c in commits]
        if len(steps) != len(set(steps)):
            self._violate("a step was committed twice")
        times = [e["t"] for e in self.events]
        if any(b < a for a, b in zip(times, times[1:])):
            self._violate("virtual time went backwards in the event trace")


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def _exactly_once(commits: list[dict[str, Any]], steps: int, cfg: SimModelConfig) -> bool:
    got = [c["step"] for c in commits]
    if sorted(got) != list(range(steps)) or not all(c["samples_covered_once"] for c in commits):
        return False
    spe = sharding.steps_per_epoch(cfg.dataset_size, cfg.global_batch_size)
    for epoch in range((steps + spe - 1) // spe):
        tally: Counter[int] = Counter()
        for s in (x for x in got if x // spe == epoch):
            tally.update(int(i) for i in sharding.global_batch(s, cfg.dataset_size, cfg.global_batch_size, cfg.seed))
        if any(v != 1 for v in tally.values()):
            return False
    return True
