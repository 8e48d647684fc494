"""A simulated cluster: the production Coordinator and N SimWorkers on a SimNetwork, in virtual
time, driven through a fault plan, with the protocol invariants checked as events happen.

    result = Cluster(workers=1024, steps=100, seed=7, plan=plan).run()

A ``coordinator_kill`` crashes the coordinator's node and, ``restart_after_s`` later, starts a
brand-new Coordinator at the same address; the workers reconnect by themselves. The checkers span
incarnations: ids from a new coordinator stay above every id before (fencing), and a step that a
live worker applied is never committed again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from phalanx.faults.plan import EMPTY_PLAN, Fault, FaultKind, FaultPlan
from phalanx.faults.targets import cut_off, link_scope, partition_sides
from phalanx.faults.timeline import FaultTimeline
from phalanx.membership.commit_log import CommitLogWriter, CommitRecord, merge_commits, read_commits, read_superseded
from phalanx.membership.coordinator import Coordinator, CoordinatorConfig
from phalanx.membership.failure_detector import DetectorConfig
from phalanx.membership.quorum import QuorumConfig
from phalanx.core.errors import ConfigError
from phalanx.sim.host import SimHost
from phalanx.sim.lab_session import require_lab_session
from phalanx.sim.loop import run_virtual
from phalanx.sim.network import Impairment, LinkModel, SimNetwork
from phalanx.sim.process_group import CollectiveModel, SimProcessGroupFactory
from phalanx.sim.worker import SimCheckpoints, SimWorker, SimWorkerEnv, digest_lines
from phalanx.core.modes import ConsistencyMode, ModeConfig
from phalanx.sim.workload import RegressionData, SimModelConfig, reference_params
from phalanx.train import sharding


_LINK_KINDS = frozenset({FaultKind.LATENCY, FaultKind.LOSS, FaultKind.BANDWIDTH, FaultKind.DUPLICATE,
                         FaultKind.REORDER})


def _worker_id(worker: int | str) -> str:
    return worker if isinstance(worker, str) else f"w{worker}"


@dataclass
class SimResult:
    ok: bool
    reason: str
    violations: list[str]
    summary: dict[str, Any]
    commits: list[dict[str, Any]]  # one per step: the decision that stuck
    events: list[dict[str, Any]]
    spans: list[dict[str, Any]]
    digest: str
    applied: list[tuple[float, str, int, int]] = field(default_factory=list)  # (t, worker, step, quorum_id)
    superseded: list[dict[str, Any]] = field(default_factory=list)  # commit decisions lost with a coordinator

    # ---- accessors for tests and tools ----
    def events_of(self, kind: str, worker: int | str | None = None) -> list[dict[str, Any]]:
        wid = None if worker is None else _worker_id(worker)
        return [e for e in self.events if e["event"] == kind and (wid is None or e.get("worker") == wid)]

    def first(self, kind: str, worker: int | str | None = None, after_s: float = -1.0) -> dict[str, Any] | None:
        return next((e for e in self.events_of(kind, worker) if e["t"] > after_s), None)

    def committed_by(self, worker: int | str) -> list[int]:
        """Steps whose committing quorum included this worker."""
        wid = _worker_id(worker)
        return [c["step"] for c in self.commits if wid in c["members"]]

    def applied_by(self, worker: int | str) -> list[tuple[float, int]]:
        """(virtual time, step) of every step this worker applied to its parameters, any incarnation."""
        wid = _worker_id(worker)
        return [(t, step) for t, w, step, _ in self.applied if w == wid]

    def commits_between(self, start_s: float, end_s: float) -> list[dict[str, Any]]:
        return [c for c in self.commits if start_s < c["committed_at_s"] < end_s]

    def quorums(self) -> list[tuple[float, int, list[str]]]:
        """(time, quorum id, members) of every quorum formed, every coordinator incarnation."""
        return [(e["t"], e["quorum_id"], e["members"]) for e in self.events_of("quorum_formed")]

    def fault(self, kind: str, index: int = 0) -> dict[str, Any]:
        """The summary record of the index-th injected fault of this kind (detection/recovery times)."""
        return [f for f in self.summary["faults"] if f["kind"] == kind][index]


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
    restart_delay_s: float = 2.0  # a killed worker's replacement joins after this long (a real launcher's hold included)
    restart_delays_s: tuple[float, ...] = ()  # the k-th restart takes the k-th of these (a real run's own)
    heal_load_s: float = 0.0  # a healed worker loads the received state for this long (deserialise, copy)
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    collective_timeout_s: float = 5.0
    max_virtual_s: float = 3600.0
    record_spans: bool | None = None  # default: only for small clusters
    commits_kept: int = 4096  # the coordinator's in-memory ring of commit records (CoordinatorConfig)
    commit_log: str = ""  # a file: every incarnation appends its commits there, as on real runs (else a list)
    modes: ModeConfig = field(default_factory=ModeConfig)  # strict, available or local-sgd
    checkpoint_every_steps: int = 0  # durable (in-memory) checkpoints every K steps; the last step always
    process_exit_s: float = 0.0  # a killed process's sockets reset this long after the kill
    process_exits_s: tuple[float, ...] = ()  # the k-th worker kill's reset takes the k-th of these (a real run's own)
    gradient_bytes: int = 0  # > 0: collectives cost as for a model with this many gradient bytes
    min_workers: int = 1  # the quorum's floor (the launcher's --min-workers); N = a fixed world
    # Lab only (refused outside a lab session): False = a restarted coordinator starts without the
    # durable floor of quorum ids and committed step its predecessor recorded, i.e. no fencing
    restart_fencing_floor: bool = True

    def __post_init__(self) -> None:
        self.plan.validate_workers(self.workers)  # every target index, with its line, before the run
        self.plan.require_supported("sim")
        if not self.restart_fencing_floor:
            require_lab_session("Cluster(restart_fencing_floor=False)")
        if not 1 <= self.min_workers <= self.workers:
            raise ConfigError(f"min_workers = {self.min_workers}: must be between 1 and the {self.workers} workers")
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
        # One clock for every coordinator incarnation (each counts "t" from its own start).
        ev["t"] = ev["mono"] = round(self._loop.time(), 6)
        self.events.append(ev)
        kind = ev["event"]
        if kind == "quorum_formed":
            qid, members = ev["quorum_id"], tuple(ev["members"])
            prev = self._quorum_members.setdefault(qid, members)
            if prev != members:
                self._violate(f"quorum id {qid} was used by two different member sets")
            if qid < self._last_qid:
                self._violate(f"quorum id went back from {self._last_qid} to {qid}")
            if qid <= self._fence_qid:
                self._violate(f"coordinator incarnation {self._coord_epoch} formed quorum id {qid}, not above "
                              f"id {self._fence_qid} of a dead incarnation: fencing cannot tell them apart")
            self._last_qid = max(self._last_qid, qid)
        elif kind == "worker_joined" and (ev["worker"], ev["incarnation"]) in self._killed:
            self._violate(f"{ev['worker']}'s killed process (incarnation {ev['incarnation']}) joined again")
        elif kind == "step_committed":
            qid, members, step = ev["quorum_id"], tuple(ev["members"]), ev["step"]
            if self._quorum_members.setdefault(qid, members) != members:
                self._violate(f"quorum id {qid} was used by two different member sets")
            holders = sorted(w.worker_id for w in self.sim_workers
                             if w.agent is not None and w.agent.last_committed_step >= step)
            if holders:
                self._violate(f"step {step} was committed again while {', '.join(holders)} already applied it: "
                              "a committed step was lost")
            self._committed[step] = (qid, set(members))
            self.cluster_step = max(self.cluster_step, step)
        self.timeline.observe(ev, self._loop.time())

    def on_worker_commit(self, w: SimWorker, step: int, quorum_id: int, params: bytes) -> None:
        """``params``: the worker's parameters after the step, as bytes (compared exactly; no hash)."""
        self._applied.append((round(self._loop.time(), 6), w.worker_id, step, quorum_id))
        rec = self._committed.get(step)
        if rec is None or rec[0] != quorum_id or w.worker_id not in rec[1]:
            self._violate(f"{w.worker_id} committed step {step} in quorum {quorum_id} outside a committed quorum")
        first = self._step_params.setdefault(step, params)
        if first != params:
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
        self.timeline = FaultTimeline()  # when faults fire and what they did (as on real runs)
        self._quorum_members: dict[int, tuple[str, ...]] = {}
        self._committed: dict[int, tuple[int, set[str]]] = {}
        self._step_params: dict[int, bytes] = {}
        self._last_qid = 0
        self._fence_qid = 0  # every id formed by a dead coordinator incarnation
        self._coord_epoch = 0  # coordinator incarnation
        self._state_lost: tuple[float, int] | None = None  # (time, step): see _note_state_loss
        # dead incarnations as they were when killed: (start time, commit records, steps retried)
        self._retired: list[tuple[float, list[CommitRecord], int]] = []
        self._commit_writer = CommitLogWriter(Path(self.commit_log)) if self.commit_log else None
        self._applied: list[tuple[float, str, int, int]] = []
        self._killed: set[tuple[str, str]] = set()  # (worker, incarnation) of every killed process
        self.cluster_step = -1  # highest step committed by any incarnation
        (ok, reason), loop = run_virtual(self._main(), self.seed)
        wall_s = time.perf_counter() - t0
        return self._result(ok, reason, loop.time(), wall_s, loop.timer_events)

    async def _main(self) -> tuple[bool, str]:
        self._loop = asyncio.get_running_loop()
        self._rng = random.Random(f"compute:{self.seed}")
        self.net = SimNetwork(self.seed, self.link, self.racks, process_exit_s=self.process_exit_s)
        self.net.install_task_factory(self._loop)
        self.pgf = SimProcessGroupFactory(self.net, self.collective, self.gradient_bytes)
        self.data = RegressionData(self.model_cfg)
        self._cnode = self.net.add_node("coordinator")
        self._coord_lock = asyncio.Lock()
        self._coord_up = False
        self.sim_workers: list[SimWorker] = []
        self.coordinator_address = await self._start_coordinator("coordinator", None)
        env = SimWorkerEnv(self.net, self.pgf, self.data, self.model_cfg, self.coordinator_address, self.seed,
                           self.steps, self.max_virtual_s, SimCheckpoints(), heal_load_s=self.heal_load_s)
        self._restarts_begun = 0
        self._kills = 0
        self.sim_workers = [SimWorker(env, self, i) for i in range(self.workers)]
        self._to_join = {f"w{i}" for i in self.plan.joiners}  # not there yet: started by their join fault
        for w in self.sim_workers:
            if w.worker_id not in self._to_join:
                w.start()
        faults = [asyncio.ensure_future(self._inject(f)) for f in self.plan.faults]
        try:
            return await self._wait_done()
        finally:
            for f in faults:
                f.cancel()
            if self._coord_up:
                await self.coord.stop("simulation finished")

    async def _start_coordinator(self, bind: str, resume: tuple[str, int] | None,
                                 floor: tuple[int, int, tuple[str, ...]] = (0, -1, ())) -> str:
        """A Coordinator process on the coordinator node; events of an incarnation that has since
        died are dropped (a SIGKILLed process runs no cleanup: its cancelled tasks' finally blocks
        are a simulator artifact, not the protocol's output)."""
        self.net.revive(self._cnode)
        epoch = self._coord_epoch

        def on_event(ev: dict[str, Any]) -> None:
            if epoch == self._coord_epoch:
                self.on_event(ev)

        # workers that join later are not waited for at the start (else the first quorum would wait
        # initial_wait_s for them)
        quorum = QuorumConfig(min_workers=self.min_workers, expected_workers=self.workers - len(self.plan.joiners))
        ccfg = CoordinatorConfig(detector=self.detector, quorum=quorum, collective_timeout_s=self.collective_timeout_s,
                                 run_id=f"sim-{self.seed}", modes=self.modes,
                                 checkpoint_every_steps=self.checkpoint_every_steps, run_dir="sim://run")
        self._coord_t0 = self._loop.time()
        # every record of this incarnation (the coordinator keeps only a ring): a list, or the log file
        self._coord_records: list[CommitRecord] = []
        sink = (self._commit_writer.incarnation(self._coord_t0) if self._commit_writer is not None
                else self._coord_records.append)
        self.coord = Coordinator(SimHost(self.net, self._cnode, self.seed),
                                 dataclasses.replace(ccfg, commits_kept=self.commits_kept), "sim-store", on_event,
                                 resume=resume, on_commit=sink)
        self.coord.raise_floor(*floor)
        address = await self.net.spawn(self._cnode, self.coord.start(bind), "start")
        self._coord_up = True
        return address

    async def _restart_coordinator(self, restart_after_s: float) -> None:
        async with self._coord_lock:  # a kill that lands while it is down waits for the restart
            await self._kill_and_restart_coordinator(restart_after_s)

    async def _kill_and_restart_coordinator(self, restart_after_s: float) -> None:
        self._coord_up = False
        old = self.coord
        # what it did after this instant (its cancelled tasks' finally blocks) never happened
        self._retired.append((self._coord_t0, list(self._coord_records), old.steps_retried))
        self._coord_epoch += 1
        self._fence_qid = self._last_qid
        self.net.crash(self._cnode)
        await asyncio.sleep(restart_after_s)
        # The durable checkpoint a real restart would --resume from; the simulated workers write
        # none yet (checkpoint_every_steps = 0), so this stays None and the workers' Hellos tell
        # the new incarnation the cluster step and the highest quorum id.
        resume = old.checkpoint if old.checkpoint[1] >= 0 else None
        # The launcher's durable floor (RUN/coordinator_floor, written before each new id or commit
        # went out): ids above every id the dead incarnation issued and no committed step committed
        # again, even if only a worker that has not reconnected yet (a frozen one) saw them.
        floor = (self._fence_qid, self.cluster_step, self._last_commit_members())
        if not self.restart_fencing_floor:  # lab only: the new incarnation cannot fence the old one's epochs
            floor = (0, -1, ())
        address = await self._start_coordinator(self.coordinator_address, resume, floor=floor)
        assert address == self.coordinator_address, "a restarted coordinator listens at the same address"

    def _note_state_loss(self) -> None:
        """Record the first moment no live process holds the newest state: step cluster_step, or
        the one before for a member of that commit (its decision still in flight). Without
        checkpoints the cluster cannot go on from there, in the simulator as in a real run: the
        liveness phase of a sweep expects that stall instead of progress."""
        if self._state_lost is not None or self.cluster_step < 0:
            return
        s = self.cluster_step
        members = self._committed.get(s, (0, set()))[1]
        # a live process holds it, or is a member of its commit with the decision still on the way
        held = [o.agent.last_committed_step >= s or (o.worker_id in members and o.agent.last_committed_step == s - 1)
                for o in self.sim_workers if o.agent is not None and o.node.alive]
        if not any(held):
            self._state_lost = (round(self._loop.time(), 6), s)
            self.emit("all_state_lost", step=s)

    def _last_commit_members(self) -> tuple[str, ...]:
        entry = self._committed.get(self.cluster_step)
        return tuple(sorted(entry[1])) if entry else ()

    def emit(self, event: str, **fields: Any) -> None:
        """A simulator event (a fault, a heal) in the trace, whether or not a coordinator is up."""
        self.on_event({"t": 0.0, "node": "coordinator", "event": event, **fields})

    async def _wait_done(self) -> tuple[bool, str]:
        last_progress, last_step = self._loop.time(), -1
        while True:
            await asyncio.sleep(0.25)
            now = self._loop.time()
            started = [w for w in self.sim_workers if w.worker_id not in self._to_join]
            if all(w.finished or w.gone for w in started) and not self._pending_restarts():
                if not self._to_join:
                    return True, "all workers finished"
                late = ", ".join(sorted(self._to_join))
                for w in self.sim_workers:
                    if w.worker_id in self._to_join:
                        w.ended = "the job finished before its join was due"
                return True, f"all workers finished ({late} never joined: the job finished before the trigger)"
            if self.cluster_step != last_step:
                last_step, last_progress = self.cluster_step, now
            if now - last_progress > 120.0:
                return False, f"no step committed for 120 virtual s (last step {last_step}): {self.coord.stall_reason}"
            if now > self.max_virtual_s:
                return False, f"passed the virtual time limit of {self.max_virtual_s:.0f} s"

    def _pending_restarts(self) -> bool:
        return any(not w.node.alive and not w.gone for w in self.sim_workers)

    # ---- faults ----
    async def _trigger(self, f: Fault) -> None:
        """faults/timeline.py: at_step = N within 5 ms after step N-1 commits (a poll, as on real
        runs, so the fault lands at a varying point of the step); at_s = T at exactly T virtual
        seconds after the first committed step."""
        await self.timeline.wait_until_due(f, lambda: self.cluster_step + 1, self._loop.time, asyncio.sleep)

    async def _inject(self, f: Fault) -> None:
        await self._trigger(f)
        w = self.sim_workers[f.worker] if f.worker is not None else None
        while w is not None and f.kind is not FaultKind.JOIN and w.worker_id in self._to_join:
            await asyncio.sleep(0.01)  # the plan parser puts it after the join; keep that order here too
        now = self._loop.time()
        rec = self.timeline.record(f, self.cluster_step + 1, now)
        self.emit("fault_injected", kind=f.kind.value, worker=w.worker_id if w else None,
                  at_step=rec.at_step, description=f.describe())
        k = f.kind
        if k is FaultKind.COORDINATOR_KILL:
            await self._restart_coordinator(float(f.param("restart_after_s", 1.0)))
            # detected when the replacement admits its first worker, recovered at its first commit
            rec.restarted = True
            rec.end(self._loop.time())
            return
        if k is FaultKind.JOIN:  # a brand-new process, no state: it heals from a peer, then takes part
            assert w is not None and w.agent is None
            self._to_join.discard(w.worker_id)
            w.start()
            return
        if k is FaultKind.KILL:
            assert w is not None
            if not w.node.alive:
                # already dead, its restart pending: like SIGKILL to a process that has exited, this
                # does nothing (and must not start a second process for the worker)
                self.emit("fault_skipped", kind=k.value, worker=w.worker_id, reason="the process is not running")
                return
            if w.agent is not None:
                self._killed.add((w.worker_id, w.agent.incarnation))
            k_th, self._kills = self._kills, self._kills + 1
            w.crash(self.process_exits_s[k_th] if k_th < len(self.process_exits_s) else None)
            self._note_state_loss()
            if not f.restart:
                w.gone = True
                return
            k_th, self._restarts_begun = self._restarts_begun, self._restarts_begun + 1
            await asyncio.sleep(self.restart_delays_s[k_th] if k_th < len(self.restart_delays_s) else self.restart_delay_s)
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
            sides = partition_sides(f, self.workers)
            self.net.partition(sides, one_way=bool(f.param("one_way", False)))
            rec.targets = cut_off(sides, self.workers)
        elif k in _LINK_KINDS:
            impairment = self._impairment(f)
            self.net.impair(impairment)
        else:
            raise AssertionError(f"fault kind {k.value} reached the simulator unchecked")
        if f.for_s:
            await asyncio.sleep(f.for_s)
            rec.end(self._loop.time())
            if k is FaultKind.STRAGGLER and w is not None:
                w.straggle_factor = 1.0
            elif k is FaultKind.PARTITION:
                self.net.heal_partition()
                self.emit("partition_healed")
            elif k in _LINK_KINDS:
                self.net.restore(impairment)

    def _impairment(self, f: Fault) -> Impairment:
        """The link fields a network fault overrides, on the links it names."""
        k = f.kind
        if k is FaultKind.LATENCY:
            changes: dict[str, Any] = {"latency_s": float(f.param("mean_ms", 0.0)) / 1000,
                                       "jitter_s": float(f.param("jitter_ms", 0.0)) / 1000,
                                       "distribution": str(f.param("distribution", "normal"))}
        elif k is FaultKind.LOSS:
            changes = {"loss": float(f.param("probability", 0.0))}
        elif k is FaultKind.BANDWIDTH:
            changes = {"bandwidth_bytes_per_s": float(f.param("bytes_per_s"))}
        elif k is FaultKind.DUPLICATE:
            changes = {"duplicate_probability": float(f.param("probability", 0.0))}
        else:
            changes = {"reorder_probability": float(f.param("probability", 0.0)),
                       "reorder_delay_s": float(f.param("delay_ms", 0.0)) / 1000}
        scope = link_scope(f)
        return Impairment(tuple(sorted(changes.items())), frozenset(scope.workers), frozenset(scope.pair))

    # ---- results ----
    def _result(self, ok: bool, reason: str, virtual_s: float, wall_s: float, timer_events: int) -> SimResult:
        commits, superseded = self._merged_commits()
        self._check_end()
        ref_w, ref_losses = reference_params(self.model_cfg, self.steps)
        finals = [w for w in self.sim_workers if w.completed]
        diff = max((float(np.max(np.abs(w.w - ref_w))) for w in finals), default=None)
        if diff is not None and diff > 1e-9 and self.modes.mode is not ConsistencyMode.LOCAL_SGD:
            self._violate(f"final parameters differ from the single-process reference by {diff:.3e}")
        lines = [json.dumps(e, sort_keys=True, default=str) for e in self.events]
        faults = [r.to_json() for r in self.timeline.records]
        step_times = [c["step_s"] for c in commits[1:]]
        summary = {
            "ok": ok and not self.violations, "reason": reason if not self.violations else self.violations[0],
            "simulated": True, "seed": self.seed, "workers": self.workers, "steps": self.steps,
            "steps_committed": len(commits),
            "steps_retried": sum(r for _, _, r in self._incarnations()),
            "faults": faults, "coordinator_restarts": len(self._retired), "commit_decisions_lost": len(superseded),
            "all_state_lost": None if self._state_lost is None else {"t": self._state_lost[0],
                                                                      "step": self._state_lost[1]},
            "workers_completed": sum(1 for w in self.sim_workers if w.completed),
            "workers_incomplete": {w.worker_id: w.ended or "still running" for w in self.sim_workers
                                   if not w.completed},
            "samples_exactly_once": sharding.samples_exactly_once(
                [(c["step"], c["samples_covered_once"]) for c in commits], self.steps, self.model_cfg.dataset_size,
                self.model_cfg.global_batch_size, self.model_cfg.seed),
            "final_loss": commits[-1]["loss"] if commits else None, "reference_final_loss": ref_losses[-1],
            "reference_max_abs_diff": diff, "virtual_s": round(virtual_s, 6), "wall_s": round(wall_s, 3),
            "goodput_steps_per_virtual_s": round(len(commits) / virtual_s, 4) if virtual_s else None,
            "median_step_s": round(float(np.median(step_times)), 6) if step_times else None,
            "timer_events": timer_events, "violations": self.violations,
            "control_plane": {"bytes_sent": self.net.bytes_sent, "frames_sent": self.net.messages_sent,
                              "bytes_duplicated": self.net.bytes_duplicated,
                              "frames_reordered": self.net.frames_reordered},
            "collectives": self.pgf.collectives,
            "quorum_requests": dict(self.coord.quorum_requests),  # of the last coordinator incarnation
        }
        return SimResult(summary["ok"], summary["reason"], self.violations, summary, commits, self.events,
                         self.spans, digest_lines(lines), self._applied, superseded)

    def _incarnations(self) -> list[tuple[float, list[CommitRecord], int]]:
        live = [(self._coord_t0, self._coord_records, self.coord.steps_retried)] if self._coord_up else []
        return self._retired + live

    def _merged_commits(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Every incarnation's commit records on one clock, merged as on real runs
        (membership/commit_log.py): a decision that died with its coordinator before any worker
        applied it is redone by the next one (the checkers prove nobody applied it); the redo is
        the record that stuck, the lost one is listed as superseded."""
        if self._commit_writer is not None:  # streamed back from the log, checked line by line
            self._commit_writer.close()
            path = self._commit_writer.path
            return [_commit_json(c) for c in read_commits(path)], [_commit_json(c) for c in read_superseded(path)]
        incarnations = []
        for t0, records, _ in self._incarnations():
            if len({c.step for c in records}) != len(records):
                self._violate("a coordinator committed a step twice")
            incarnations.append([dataclasses.replace(c, committed_at_s=round(t0 + c.committed_at_s, 6))
                                 for c in records])
        merged, superseded = merge_commits(incarnations)
        return [_commit_json(c) for c in merged], [_commit_json(c) for c in superseded]

    def _check_end(self) -> None:
        times = [e["t"] for e in self.events]
        if any(b < a for a, b in zip(times, times[1:])):
            self._violate("virtual time went backwards in the event trace")


def _commit_json(c: CommitRecord) -> dict[str, Any]:
    return {"step": c.step, "quorum_id": c.quorum_id, "members": list(c.members), "loss": c.loss,
            "step_s": c.step_s, "committed_at_s": c.committed_at_s, "samples_covered_once": c.covered_once}
