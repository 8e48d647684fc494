"""``phalanx launch``: an embedded (or remote) coordinator plus N supervised worker processes.

A local run is the multi-machine path with the coordinator on loopback: the same Coordinator,
TcpTransport and worker code. The launcher also runs the fault plan and writes the run folder.
With ``network="namespaces"`` every worker runs in a network namespace of its own behind a bridge
(:mod:`netns`), and partition/bandwidth faults are acted out in the kernel. Coordinator kills and
kernel faults are the launcher's own (:mod:`launcher_faults`); the FaultInjector gets the rest.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx.collectives.process_group import RendezvousStore
from phalanx.core import event_loop
from phalanx.core.auth import generate_token, read_token_file, write_token_file
from phalanx.core.errors import JobFailed
from phalanx.core.modes import ModeConfig
from phalanx.faults.plan import EMPTY_PLAN, FaultKind, FaultPlan
from phalanx.faults.timeline import FaultTimeline
from phalanx.membership.commit_log import COMMITS_FILE, CommitHistory, CommitLogWriter, CommitRecord, commit_json
from phalanx.membership.coordinator import Coordinator, CoordinatorConfig
from phalanx.membership.failure_detector import DetectorConfig
from phalanx.membership.quorum import QuorumConfig
from phalanx.runtime.event_log import EventLog, EventsWriter
from phalanx.runtime.fault_injector import FaultInjector
from phalanx.runtime.launcher_faults import (
    CoordinatorHolder, DurableFloor, LauncherFaults, network_seams_env, split_plan,
)
from phalanx.runtime.netns import KernelFaults, NamespaceNetwork, NetworkSetupError
from phalanx.runtime.progress import Progress
from phalanx.runtime.restart_hold import RESTART_HOLD_MAX_S, RestartHold
from phalanx.runtime.run_dir import is_phalanx_run
from phalanx.runtime.supervisor import Supervisor
from phalanx.train.host_memory import worker_hugepage_env
from phalanx.transport.real_host import RealHost
from phalanx.transport.tcp import TcpTransport, TlsFiles


STALL_GRACE_S = 3.0
# how often the launcher looks at its job when nothing wakes it (a worker's exit does, at once): the
# stall and wall-clock limits and the progress display; every POLL_S while a restart is held for a
# commit, or where the platform cannot report exits (it woke every 50 ms, ~5 ms of CPU a second)
SUPERVISE_S, POLL_S = 0.25, 0.05
NETWORKS = ("loopback", "namespaces")


@dataclass
class LaunchConfig:
    argv: list[str]
    workers: int
    run_dir: Path
    fault_plan: FaultPlan = EMPTY_PLAN
    restart_failed: bool = False
    coordinator: str = ""  # HOST:PORT of a remote coordinator; "" = embedded on loopback
    token_file: str = ""
    resume: bool = False
    total_steps: int | None = None  # for the progress bar only
    checkpoint_every_steps: int = 0
    data_seed: int = 0
    min_workers: int = 1
    modes: ModeConfig = ModeConfig()
    detector: DetectorConfig = DetectorConfig()
    collective_timeout_s: float = 5.0
    max_wall_s: float = 1800.0
    stall_timeout_s: float = 60.0
    extra_env: dict[str, str] = field(default_factory=dict)
    show_progress: bool = True
    network: str = "loopback"  # or "namespaces": one network namespace per worker (root only)
    commits_kept: int = CoordinatorConfig.commits_kept  # in memory; every commit is in RUN/commits.jsonl
    restart_hold_s: float = RESTART_HOLD_MAX_S  # a replacement starts once the survivors commit, or after this


@dataclass
class LaunchResult:
    ok: bool
    reason: str
    wall_s: float
    commits: CommitHistory | list[Any]  # streamed from RUN/commits.jsonl; [] with a remote coordinator
    steps_retried: int
    faults: list[dict[str, Any]]
    events: EventLog | list[dict[str, Any]]  # read back from RUN/events.jsonl (this launch's part)
    transport: dict[str, Any]


def launch(cfg: LaunchConfig) -> LaunchResult:
    if cfg.network not in NETWORKS:
        raise NetworkSetupError(f"unknown network {cfg.network!r}: use one of {', '.join(NETWORKS)}")
    if cfg.network == "loopback":
        return event_loop.run(_launch(cfg, None))
    if cfg.coordinator:
        raise NetworkSetupError("--network namespaces runs the coordinator embedded on the run's bridge; "
                                "it cannot be combined with --coordinator")
    net = NamespaceNetwork(cfg.workers)
    try:  # torn down here as well as in _launch, so an interrupted run leaves nothing behind either
        net.setup()
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        net.write_description(cfg.run_dir)
        return event_loop.run(_launch(cfg, net))
    finally:
        net.teardown()


async def _launch(cfg: LaunchConfig, net: NamespaceNetwork | None) -> LaunchResult:
    """A run in five steps: open its outputs, start (or reach) the coordinator, start the
    workers and the fault plan, watch until the job ends, shut everything down."""
    run = _Run(cfg, net)
    address = await run.start_coordinator()
    run.start_workers_and_faults(address)
    try:
        ok, reason = await _supervise(cfg, run.sup, run.holder, run.injector, run.progress, run.t0, run.on_event,
                                      run.own_task)
    except BaseException:
        await run.shut_down("launcher interrupted")
        raise
    await run.shut_down(reason or "job finished")
    return run.result(ok, reason)


class _Run:
    """The state of one launch: outputs, coordinator, workers, fault plan, and their shutdown."""

    def __init__(self, cfg: LaunchConfig, net: NamespaceNetwork | None) -> None:
        self.cfg, self.net, self.t0 = cfg, net, time.monotonic()
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self.token_path = Path(cfg.token_file) if cfg.token_file else cfg.run_dir / "token"
        if cfg.token_file:
            read_token_file(self.token_path)  # validate early, with a clear message
        else:
            if is_phalanx_run(cfg.run_dir):
                self.token_path.unlink(missing_ok=True)  # the previous run's (a link is removed, not followed)
            write_token_file(self.token_path, generate_token())  # a fresh token for every local run, mode 600
        self.token = read_token_file(self.token_path)
        self.late_events: list[dict[str, Any]] = []  # after events.jsonl closed; the rest is read back from it
        self.events_file = EventsWriter(cfg.run_dir / "events.jsonl")
        self.events_start = (cfg.run_dir / "events.jsonl").stat().st_size  # a resumed run appends to the file
        self.timeline = FaultTimeline()  # when faults fire and what they did: one for the whole run
        self.injector: FaultInjector | None = None
        self.own: LauncherFaults | None = None
        self.own_task: asyncio.Future[Any] | None = None
        self._inj_task: asyncio.Future[Any] | None = None
        self.holder: CoordinatorHolder | None = None
        self.commit_log: CommitLogWriter | None = None  # RUN/commits.jsonl, with the embedded coordinator
        self.progress = Progress(cfg.workers, cfg.total_steps, enabled=cfg.show_progress)
        # Only a coordinator restart reads the floor, and only a coordinator_kill restarts it: without
        # one, no file write (~0.1 ms) sits on the commit path.
        self.floor = DurableFloor(cfg.run_dir) if any(f.kind is FaultKind.COORDINATOR_KILL
                                                      for f in cfg.fault_plan.faults) else None
        tls = TlsFiles.from_env({**os.environ, **cfg.extra_env})  # the workers get the same environment
        self.transport = TcpTransport(self.token, name="coordinator", tls=tls, on_reject=lambda peer, why: self.on_event(
            {"t": time.monotonic() - self.t0, "mono": time.monotonic(), "node": "coordinator",
             "event": "connection_refused", "peer": peer, "reason": why}))
        self.kernel = KernelFaults(net) if net is not None else None
        self.injector_plan, self.kernel_faults, self.kills = split_plan(cfg.fault_plan, self.kernel)
        for f in self.kernel_faults:
            assert self.kernel is not None
            self.kernel.check(f, cfg.fault_plan.path)

    def on_event(self, ev: dict[str, Any]) -> None:
        now = time.monotonic()
        ev.setdefault("mono", round(now, 6))  # the clock worker span logs use too
        if self.floor is not None and ev.get("event") == "quorum_formed":  # before it leaves the process
            self.floor.raise_to(int(ev["quorum_id"]))
        elif self.floor is not None and ev.get("event") == "step_committed":
            self.floor.raise_to(int(ev["quorum_id"]), int(ev["step"]), tuple(ev["members"]))
        if not self.events_file.closed:
            self.events_file.write(ev)
        else:  # late events during shutdown are kept in memory only
            self.late_events.append(ev)
        self.timeline.observe(ev, now)
        self.progress.on_event(ev)

    async def start_coordinator(self) -> str:
        cfg = self.cfg
        if cfg.coordinator:
            if self.kills:
                raise JobFailed("coordinator_kill needs the embedded coordinator; it cannot kill a remote "
                                "--coordinator")
            if cfg.fault_plan.joiners:  # the fault injector starts them, with the embedded coordinator
                raise JobFailed("a join fault needs the embedded coordinator; with a remote --coordinator, start "
                                "the late worker yourself")
            return cfg.coordinator
        host = self.net.coordinator_host if self.net is not None else "127.0.0.1"
        self._store = RendezvousStore(host)  # listens on host only; kept alive for the run
        # every incarnation appends to one log; a resumed launch continues the earlier launch's
        self.commit_log = CommitLogWriter(cfg.run_dir / COMMITS_FILE, append=cfg.resume)
        self._new_coordinator = _coordinator_factory(cfg, self.transport, self._store.address, self.on_event,
                                                     self.commit_log)
        self.holder = CoordinatorHolder(self._new_coordinator(_resume_point(cfg) if cfg.resume else None, 0.0),
                                        self.commit_log.history())
        self._first_mono = time.monotonic()
        self.address = await self.holder.current.start(f"{host}:0")
        return self.address

    async def _restart_coordinator(self) -> None:
        """A brand-new coordinator on the same address; it knows only the newest durable checkpoint
        and what the workers' Hellos tell it (cluster step, highest quorum id)."""
        assert self.holder is not None
        shift_s = time.monotonic() - self._first_mono
        new = self._new_coordinator(_newest_checkpoint(self.cfg), shift_s)
        # Ids above every id the dead coordinator issued, and no step it committed committed again,
        # even if only a worker that has not reconnected yet (a frozen one) saw them: the floor is
        # on disk, written before each new id or commit went out.
        new.raise_floor(*DurableFloor.read(self.cfg.run_dir))
        await _start_on(new, self.address)
        self.holder.replace(new, shift_s)
        if self.injector is not None:
            self.injector.coord = new  # the injector's triggers and injections follow the new incarnation

    def start_workers_and_faults(self, address: str) -> None:
        cfg = self.cfg
        env = {**os.environ, **cfg.extra_env, "PHALANX_COORDINATOR": address, "PHALANX_TOKEN_FILE": str(self.token_path),
               "PHALANX_RUN_DIR": str(cfg.run_dir), "PHALANX_DATA_SEED": str(cfg.data_seed), "PYTHONUNBUFFERED": "1",
               **network_seams_env(self.injector_plan, cfg.coordinator)}
        env.update(worker_hugepage_env(env)[0])  # a killed worker's sockets close sooner (train/host_memory.py)
        self.sup = Supervisor(cfg.argv, env, cfg.run_dir, cfg.workers, cfg.restart_failed,
                              wrap=self.net.worker_command if self.net is not None else None,
                              joiners=cfg.fault_plan.joiners)
        if self.holder is not None:
            self.injector = FaultInjector(self.injector_plan, self.holder.current, self.sup, self.timeline)
            self.own = LauncherFaults(self.holder, self._restart_coordinator, self.timeline, lambda event, **kw:
                                      self.on_event({"t": time.monotonic() - self.t0, "node": "launcher",
                                                     "event": event, **kw}))
        self.sup.start_all()
        if self.injector is not None:
            self._inj_task = asyncio.ensure_future(self.injector.run())
        if self.own is not None and (self.kernel_faults or self.kills):
            self.own_task = asyncio.ensure_future(self.own.run(self.kernel, self.kernel_faults, self.kills))
        self.progress.start()

    async def shut_down(self, reason: str) -> None:
        self.progress.stop()
        for task in (self._inj_task, self.own_task):
            if task is not None:
                task.cancel()
        self.sup.stop_all()
        if self.holder is not None:
            await self.holder.current.stop(reason)
        if self.net is not None:
            self.net.teardown()
        if getattr(self, "_store", None) is not None:
            self._store.close()  # the rendezvous store's server and socket end with the run
            self._store = None
        for c in self.holder.superseded() if self.holder is not None else []:
            self.on_event({"t": time.monotonic() - self.t0, "node": "launcher", "event": "commit_superseded",
                           "step": c.step, "quorum_id": c.quorum_id, "reason": "recorded by a coordinator that "
                           "crashed before any worker acted on it; the step was committed again"})
        self.events_file.close()
        if self.commit_log is not None:
            self.commit_log.close()

    def result(self, ok: bool, reason: str) -> LaunchResult:
        records = sorted(self.timeline.records, key=lambda r: r.injected_s)
        t = self.transport.stats
        return LaunchResult(ok, reason, time.monotonic() - self.t0, self.holder.commits() if self.holder else [],
                            self.holder.steps_retried if self.holder else 0, [r.to_json() for r in records],
                            EventLog(self.cfg.run_dir / "events.jsonl", self.events_start, self.late_events),
                            {"bytes_sent": t.bytes_sent, "frames_sent": t.frames_sent,
                             "bytes_received": t.bytes_received, "frames_received": t.frames_received,
                             "rejected": t.rejected})


def _coordinator_factory(cfg: LaunchConfig, transport: TcpTransport, store_address: str,
                         on_event: Callable[[dict[str, Any]], None],
                         commit_log: CommitLogWriter) -> Callable[[tuple[str, int] | None, float], Coordinator]:
    """Makes coordinator incarnations. Each counts its events' ``t`` from its own start; ``shift_s``
    (its start after the first's) moves them, and its commit records, onto the first incarnation's
    time axis. Each appends its commits to the run's one log as the next incarnation."""
    # workers that join later are not waited for at the start (the first quorum would wait
    # initial_wait_s for them); cfg.workers stays the total
    expected = cfg.workers - len(cfg.fault_plan.joiners)
    ccfg = CoordinatorConfig(detector=cfg.detector,
                             quorum=QuorumConfig(min_workers=cfg.min_workers, expected_workers=expected),
                             collective_timeout_s=cfg.collective_timeout_s,
                             checkpoint_every_steps=cfg.checkpoint_every_steps, run_dir=str(cfg.run_dir),
                             run_id=cfg.run_dir.name, modes=cfg.modes, commits_kept=cfg.commits_kept)

    def make(resume: tuple[str, int] | None, shift_s: float) -> Coordinator:
        def shifted(ev: dict[str, Any]) -> None:
            ev["t"] = round(ev["t"] + shift_s, 6)
            on_event(ev)

        return Coordinator(RealHost("coordinator", transport), ccfg, store_address,
                           shifted if shift_s else on_event, resume, on_commit=commit_log.incarnation(shift_s))

    return make


async def _start_on(coord: Coordinator, address: str, tries: int = 20) -> None:
    """Listen on exactly ``address`` again: the port the workers reconnect to."""
    for attempt in range(tries):
        try:
            await coord.start(address)
            return
        except OSError as e:
            if attempt == tries - 1:
                raise JobFailed(f"the restarted coordinator cannot listen on {address} again: {e}") from e
            await asyncio.sleep(0.1)


async def _supervise(cfg: LaunchConfig, sup: Supervisor, holder: CoordinatorHolder | None,
                     injector: FaultInjector | None, progress: Progress, t0: float, on_event: Any,
                     own_task: asyncio.Future[Any] | None) -> tuple[bool, str]:
    stalled_since: float | None = None
    hold: RestartHold[Any] = RestartHold(cfg.restart_hold_s)

    def restart(w: Any, held_s: float) -> None:
        sup.restart(w)
        on_event({"t": now - t0, "mono": now, "node": "launcher", "event": "worker_restarted",
                  "worker": w.worker_id, "restarts": w.restarts, "held_s": round(held_s, 4)})
    watching = sup.watch_exits()
    if own_task is not None:
        own_task.add_done_callback(lambda _: sup.wake())
    while True:
        await sup.wait(SUPERVISE_S if watching and not len(hold) else POLL_S)
        now = time.monotonic()
        if own_task is not None and own_task.done() and not own_task.cancelled() and own_task.exception():
            # e.g. an `ip` command failed or the coordinator could not listen again: fail loudly
            return False, f"carrying out the fault plan failed: {own_task.exception()}"
        coord = holder.current if holder is not None else None
        for w, code in sup.poll():
            ev = {"t": now - t0, "mono": now, "node": "launcher", "event": "worker_exited", "worker": w.worker_id,
                  "exit_code": code}
            on_event(ev)
            if code == 0:
                continue
            planned = injector.kill_restart.pop(w.index, None) if injector is not None else None
            w.departed = planned is False
            if planned is not False and sup.may_restart(w, planned is True):  # False: the plan keeps it down
                running = sum(1 for x in sup.workers if x.alive and not x.frozen)
                if not hold.hold(w, now, coord.commits_total if coord else None, running, cfg.min_workers):
                    restart(w, 0.0)
        for w, held_s in hold.due(now, coord.commits_total if coord else None, not sup.any_running()):
            restart(w, held_s)  # the survivors committed (or none is left running: nothing to wait for)
        late = ", ".join(w.worker_id for w in sup.not_joined())  # not started yet: neither exited nor finished
        if sup.all_finished():
            gone = ", ".join(w.worker_id for w in sup.workers if w.departed and not w.finished)
            return True, "all workers finished" + (f" ({late} never joined: the job finished before its trigger)"
                                                   if late else "") + (f" ({gone} killed for good by the plan)"
                                                                       if gone else "")
        if not sup.any_running():
            codes = {w.worker_id: w.exit_codes[-1] for w in sup.workers if w.exit_codes}
            failed = ", ".join(w.worker_id for w in sup.workers if w.exit_codes and not w.finished and not w.departed)
            pending = f"; {late} had not joined yet" if late else ""
            why = f"{failed} exited without finishing" if failed else "the fault plan killed each for good"
            return False, (f"every started worker has exited; {why} (exit codes {codes}{pending}); "
                           f"see {cfg.run_dir}/workers/*.log")
        if coord is not None and coord.stall_reason:
            stalled_since = stalled_since or now
            # Waiting helps only if a worker that may still hold the state can come back: when every
            # local worker is connected (fresh incarnations), nobody can, so fail after a short grace.
            # (a worker that has not joined yet holds no state either)
            started = cfg.workers - len(sup.not_joined())
            nobody_missing = sum(1 for s in coord.sessions.values() if s.healthy) >= started
            limit_s = min(cfg.stall_timeout_s, STALL_GRACE_S) if nobody_missing else cfg.stall_timeout_s
            if now - stalled_since > limit_s:
                return False, f"no progress for {limit_s:.0f} s: {coord.stall_reason}"
        else:
            stalled_since = None
        if now - t0 > cfg.max_wall_s:
            return False, f"the job passed its wall-clock limit of {cfg.max_wall_s:.0f} s"
        if coord is not None:
            progress.update(coord)


def _newest_checkpoint(cfg: LaunchConfig) -> tuple[str, int] | None:
    from phalanx.checkpoint.durable import latest_checkpoint

    found = latest_checkpoint(cfg.run_dir)
    return (str(found[0]), found[1]) if found is not None else None


def _resume_point(cfg: LaunchConfig) -> tuple[str, int]:
    found = _newest_checkpoint(cfg)
    if found is None:
        raise JobFailed(f"--resume {cfg.run_dir}: no valid checkpoint found under {cfg.run_dir}/checkpoints")
    return found


def write_metrics(run_dir: Path, commits: Iterable[CommitRecord], append: bool = False) -> None:
    """metrics.jsonl from a commit history, streamed (a CommitHistory is read from disk as it goes)."""
    with open(run_dir / "metrics.jsonl", "a" if append else "w") as f:
        for c in commits:
            f.write(json.dumps(commit_json(c)) + "\n")


def python_argv(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]
