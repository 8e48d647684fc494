"""The coordinator: membership, failure detection, per-step quorum and commit decisions.

Asyncio code behind the Host seam; the same class runs embedded in ``phalanx launch``, standalone
in ``phalanx coordinator`` and, on simulated transport and clock, in the simulator. Decisions are
made by the pure functions of :mod:`quorum` and :mod:`failure_detector`; this module does the I/O.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from phalanx.core.errors import TransportError
from phalanx.core.host import Connection, Host
from phalanx.core.messages import (
    AllreduceDone, CheckpointWritten, Goodbye, HealDone, Heartbeat, Hello, InjectFault, Progress, QuorumAssigned,
    QuorumBroken, QuorumCancel, QuorumRequest, Refused, Shutdown, StepDecision, Welcome,
)
from phalanx.core.modes import ConsistencyMode, ModeConfig
from phalanx.membership import failure_detector as fd
from phalanx.membership.quorum import (
    Action, MemberView, QuorumConfig, QuorumView, Report, Verdict, decide_commit, decide_quorum,
)


@dataclass(frozen=True)
class CoordinatorConfig:
    detector: fd.DetectorConfig = fd.DetectorConfig()
    quorum: QuorumConfig = QuorumConfig()
    collective_timeout_s: float = 5.0
    checkpoint_every_steps: int = 0
    tick_s: float = 0.02
    run_dir: str = ""
    run_id: str = "run"
    modes: ModeConfig = ModeConfig()
    # how long a worker that finished holding the final state stays to heal a late peer (a frozen
    # worker that wakes after the last step); released at once when no worker can still need it
    drain_s: float = 5.0


def apply_mode(cfg: CoordinatorConfig) -> CoordinatorConfig:
    """The timeouts each consistency mode implies (core.modes explains the modes).

    available: a formed step waits at most ``deadline_s`` for members not yet asking, and a member
    that falls ``deadline_s`` behind the others inside a step is dropped from it (it rejoins at the
    next step). local-sgd: members with any state merge in instead of being healed over.
    """
    m = cfg.modes
    if m.mode is ConsistencyMode.AVAILABLE:
        q = replace(cfg.quorum, join_timeout_s=min(cfg.quorum.join_timeout_s, m.deadline_s))
        d = replace(cfg.detector, progress_timeout_s=min(cfg.detector.progress_timeout_s, max(m.deadline_s, 0.1)))
        return replace(cfg, quorum=q, detector=d)
    if m.mode is ConsistencyMode.LOCAL_SGD:
        return replace(cfg, quorum=replace(cfg.quorum, merge_stale=True))
    return cfg


@dataclass
class WorkerSession:
    worker_id: str
    incarnation: str
    conn: Connection
    pid: int
    heal_address: str
    joined_at_s: float
    last_heartbeat_s: float
    last_committed_step: int
    has_state: bool
    connected: bool = True
    suspected: str = ""  # non-empty: why it is out of the quorum
    waiting: bool = False
    waiting_since_s: float = 0.0
    # its quorum request was still unanswered when it was suspected: a worker that comes back (its
    # heartbeats resume after a partition or freeze) is still waiting on that request
    asked_when_suspected: bool = False
    phase: tuple[fd.Phase, float] = (fd.Phase.REQUESTED, 0.0)
    done: bool = False
    # said Goodbye holding the final state and still connected: a heal source for late workers
    holds_final: bool = False
    released: bool = False  # told it may leave (no worker can still need its final state)
    requested_step: int = -1  # the step number the worker asked a quorum for (local-sgd: its local step)
    outbox: asyncio.Queue[Any] = field(default_factory=lambda: asyncio.Queue(maxsize=1024))

    @property
    def healthy(self) -> bool:
        return self.connected and not self.suspected and not self.done


@dataclass
class CurrentQuorum:
    quorum_id: int
    step: int
    members: tuple[str, ...]
    formed_at_s: float
    intact: bool = True
    decided: bool = False
    reports: dict[str, Report] = field(default_factory=dict)
    losses: dict[str, float] = field(default_factory=dict)
    member_set: frozenset[str] = frozenset()  # for O(1) membership checks per message
    weights: dict[str, float] = field(default_factory=dict)  # available mode: share of the batch per member


@dataclass(frozen=True)
class CommitRecord:
    step: int
    quorum_id: int
    members: tuple[str, ...]
    loss: float
    committed_at_s: float
    step_s: float
    covered_once: bool


class Coordinator:
    def __init__(self, host: Host, cfg: CoordinatorConfig, store_address: str,
                 on_event: Callable[[dict[str, Any]], None] | None = None,
                 resume: tuple[str, int] | None = None) -> None:
        self.host, self.cfg, self.store_address = host, apply_mode(cfg), store_address
        self._on_event = on_event
        self.sessions: dict[str, WorkerSession] = {}
        self.quorum: CurrentQuorum | None = None
        self.cluster_step = resume[1] if resume else -1
        self.checkpoint: tuple[str, int] = resume if resume else ("", -1)
        self.max_id_seen = 0
        self.commits: list[CommitRecord] = []
        self.steps_retried = 0
        self.stall_reason = ""
        self.total_steps = -1  # the loop's length as workers report it (-1: unknown)
        self.completed_workers = 0  # workers that said Goodbye holding the final state
        # Counts refreshed every tick and kept roughly current in between, so a message triggers a
        # full O(workers) evaluation only when it can complete a decision (thousands of simulated
        # workers would otherwise cost O(workers^2) per step).
        self._healthy_n = 0
        self._waiting_n = 0
        self._form_blocked = False  # a message-triggered formation found nothing to form this tick
        self.events: list[dict[str, Any]] = []
        # available mode: each worker's measured speed (share of the global batch per compute second)
        self._speed: dict[str, float] = {}
        self._t0 = host.now()
        self._last_commit_s = host.now()
        self._floor_commit: tuple[int, frozenset[str]] | None = None  # see raise_floor
        self._stopped = False
        self.all_done = asyncio.Event()
        self.stalled = asyncio.Event()

    # ---- lifecycle ----
    async def start(self, bind: str) -> str:
        self._listener = await self.host.transport.listen(bind, self._serve)
        self.host.spawn(self._ticker(), "coordinator-ticker")
        self.emit("coordinator_started", address=self._listener.address, cluster_step=self.cluster_step)
        return self._listener.address

    async def stop(self, reason: str = "job finished") -> None:
        self._stopped = True
        for s in self._sorted_sessions():
            if s.connected:
                try:
                    await s.conn.send(Shutdown(reason=reason))
                except TransportError:
                    pass
        self._listener.close()

    def crash(self) -> None:
        """Die at once, like a SIGKILLed process (the ``coordinator_kill`` fault): no Shutdown, no
        further event. The listener and every connection close, the ticker stops, and the sessions
        and the current quorum are dropped, so this object decides nothing again. Workers see their
        connection fail and reconnect to whatever listens on the address next."""
        self._stopped = True
        self._listener.close()
        sessions, self.sessions, self.quorum = self._sorted_sessions(), {}, None
        for s in sessions:  # emptied first: the readers' exit paths find no session to suspect or report
            s.connected = False
            s.conn.close()  # the default reason: a crash is not a refused connection
            if not s.outbox.full():
                s.outbox.put_nowait(None)  # wakes its sender, whose send on the closed connection ends it

    def emit(self, event: str, **fields: Any) -> None:
        record = {"t": round(self.host.now() - self._t0, 6), "node": "coordinator", "event": event, **fields}
        self.events.append(record)
        self.host.log(event, **fields)
        if self._on_event:
            self._on_event(record)

    def _sorted_sessions(self) -> list[WorkerSession]:
        return [self.sessions[k] for k in sorted(self.sessions)]

    # ---- connections ----
    async def _serve(self, conn: Connection) -> None:
        try:
            first, _ = await conn.recv()
        except TransportError:
            return
        if not isinstance(first, Hello):
            await _refuse(conn, f"expected Hello, got {type(first).__name__}")
            return
        session = self._admit(first, conn)
        self.host.spawn(self._sender(session), f"send-{session.worker_id}")
        await conn.send(Welcome(run_id=self.cfg.run_id, store_address=self.store_address,
                                heartbeat_interval_s=self.cfg.detector.heartbeat_interval_s,
                                collective_timeout_s=self.cfg.collective_timeout_s,
                                checkpoint_every_steps=self.cfg.checkpoint_every_steps,
                                run_dir=self.cfg.run_dir, mode=self.cfg.modes.mode.value,
                                deadline_s=self.cfg.modes.deadline_s,
                                sync_every_steps=self.cfg.modes.sync_every_steps,
                                max_staleness_steps=self.cfg.modes.max_staleness_steps,
                                sync_timeout_s=self.cfg.modes.sync_timeout_s, drain_s=self.cfg.drain_s))
        try:
            while not conn.is_closed:
                message, _ = await conn.recv()
                self._handle(session, message)
        except TransportError as e:
            if session is self.sessions.get(session.worker_id) and not session.done:
                reason = getattr(conn, "close_reason", "") or str(e)
                self.emit("connection_lost", worker=session.worker_id, reason=reason)
        finally:
            if session is self.sessions.get(session.worker_id):
                session.connected = False
                if not session.done:
                    self._suspect(session, "connection lost")  # decides the current step if it must

    def raise_floor(self, quorum_id: int, step: int, members: tuple[str, ...] = ()) -> None:
        """A restarted incarnation starts above what its predecessors durably recorded before it
        left their process: the highest quorum id, the highest step committed and its members.

        New ids go above ``quorum_id`` (fencing). Step ``step - 1`` is certainly applied: every
        member of step ``step``'s quorum applied it before it could compute ``step``. So it counts
        as committed, and a stale worker that reconnects first waits for (and heals from) a peer
        that holds it instead of committing it again. Step ``step`` itself may have died in flight
        with the coordinator, unapplied; a worker that holds it raises the cluster step when it
        says Hello. Until each of ``members`` has said Hello (or ``rejoin_wait_s`` has passed) no
        quorum forms: so step ``step`` is redone only when none of them holds it, and the first
        worker to reconnect does not go on alone while its peers are a moment behind it.
        """
        self.max_id_seen = max(self.max_id_seen, quorum_id)
        self.cluster_step = max(self.cluster_step, step - 1)
        if members:
            self._floor_commit = (step, frozenset(members))

    def _awaiting_holders(self, now: float) -> tuple[str, ...]:
        if self._floor_commit is None:
            return ()
        step, members = self._floor_commit
        missing = tuple(sorted(m for m in members if m not in self.sessions))
        if not missing:
            self._floor_commit = None  # every member said Hello (one holding the step raised it)
            return ()
        if now - self._t0 > self.cfg.quorum.rejoin_wait_s:
            self._floor_commit = None
            self.emit("rejoin_wait_expired", step=step, missing=list(missing))
            return ()
        return missing

    def _admit(self, hello: Hello, conn: Connection) -> WorkerSession:
        now = self.host.now()
        old = self.sessions.get(hello.worker_id)
        if old is not None and old.connected:
            old.conn.close("replaced by a new incarnation")
            if old.healthy:
                self._suspect(old, "replaced by a new incarnation")
        self.max_id_seen = max(self.max_id_seen, hello.max_quorum_id_seen)
        if hello.has_state:
            self.cluster_step = max(self.cluster_step, hello.last_committed_step)
        session = WorkerSession(hello.worker_id, hello.incarnation, conn, hello.pid, hello.heal_address,
                                now, now, hello.last_committed_step, hello.has_state)
        self.sessions[hello.worker_id] = session
        self._healthy_n += 1
        self.emit("worker_joined", worker=hello.worker_id, pid=hello.pid, incarnation=hello.incarnation,
                  last_committed_step=hello.last_committed_step)
        return session

    def _handle(self, s: WorkerSession, m: Any) -> None:
        now = self.host.now()
        if isinstance(m, Heartbeat):
            s.last_heartbeat_s = now
            if s.suspected.startswith("no heartbeat"):
                self.emit("worker_alive_again", worker=s.worker_id, was=s.suspected)
                s.suspected = ""
                if s.asked_when_suspected and not s.waiting:
                    # Found by the simulator: it asked, was suspected before any answer, and kept
                    # waiting for one; without this it sat outside every quorum until the job ended.
                    s.waiting, s.waiting_since_s = True, now
                    self._waiting_n += 1
                s.asked_when_suspected = False
            return
        if isinstance(m, QuorumRequest):
            if s.suspected.startswith("no step progress"):
                self.emit("worker_alive_again", worker=s.worker_id, was=s.suspected)
                s.suspected = ""
            if not s.waiting:
                self._waiting_n += 1
            s.waiting, s.waiting_since_s = True, now
            s.last_committed_step, s.has_state = m.last_committed_step, m.has_state
            s.requested_step = m.step
            self.total_steps = max(self.total_steps, m.total_steps)
            s.phase = (fd.Phase.REQUESTED, now)
            if self._waiting_n < self._healthy_n:
                return  # others are still to ask: the ticker or the last request decides (O(1) here)
        elif isinstance(m, QuorumCancel):
            s.asked_when_suspected = False
            if s.waiting:
                s.waiting = False
                self._waiting_n -= 1
            return
        elif isinstance(m, Progress):
            q = self.quorum
            if q and m.quorum_id == q.quorum_id and s.worker_id in q.member_set:
                s.phase = (fd.Phase.ALLREDUCE, now)
            return
        elif isinstance(m, AllreduceDone):
            self._on_report(s, m)
            q = self.quorum
            if q is not None and m.ok and not q.decided and len(q.reports) < len(q.members):
                return  # a commit needs every live member; losses are handled where they are noticed
        elif isinstance(m, HealDone):
            s.has_state, s.last_committed_step = True, m.step - 1
            self.emit("worker_healed", worker=s.worker_id, source=m.source, step=m.step, quorum_id=m.quorum_id)
            return  # matters for the next formation only: the ticker takes it from here
        elif isinstance(m, CheckpointWritten):
            self.note_checkpoint(m.path, m.step)
            self.emit("checkpoint_written", worker=s.worker_id, step=m.step, path=m.path)
            return  # may unblock a stalled formation: the ticker re-evaluates within tick_s
        elif isinstance(m, Goodbye):
            s.done = True
            self.completed_workers += int(m.completed)
            if m.completed:
                s.holds_final, s.has_state, s.last_committed_step = True, True, m.final_step
            if s.waiting:
                s.waiting = False
                self._waiting_n -= 1
            self.emit("worker_finished", worker=s.worker_id, completed=m.completed, reason=m.reason)
            if all(x.done for x in self.sessions.values()):
                self.all_done.set()
            self._release_drainers()
            q = self.quorum
            if q is None or q.decided or s.worker_id not in q.member_set:
                return
        self._evaluate()

    def _on_report(self, s: WorkerSession, m: AllreduceDone) -> None:
        q = self.quorum
        if q is None or m.quorum_id != q.quorum_id or m.step != q.step or q.decided or s.worker_id not in q.member_set:
            # Fencing: an outcome from an older epoch never counts; tell the sender to roll back.
            self._send(s, StepDecision(step=m.step, quorum_id=m.quorum_id, commit=False,
                                                             reason="stale quorum id: step fenced"))
            return
        q.reports[s.worker_id] = Report(m.ok, m.samples_covered_once, m.error)
        q.losses[s.worker_id] = m.loss
        share = q.weights.get(s.worker_id, 0.0)
        if m.ok and share > 0 and m.compute_s > 0:
            speed = share / m.compute_s
            old = self._speed.get(s.worker_id)
            self._speed[s.worker_id] = speed if old is None else 0.5 * old + 0.5 * speed
        s.phase = (fd.Phase.REPORTED, self.host.now())

    def _send(self, s: WorkerSession, message: Any) -> None:
        """Queue a message for one worker; one sender task per connection keeps them in order."""
        if s.connected and not s.outbox.full():
            s.outbox.put_nowait(message)

    async def _sender(self, s: WorkerSession) -> None:
        while s.connected:
            message = await s.outbox.get()
            try:
                await s.conn.send(message)
            except TransportError:
                return

    # ---- decisions ----
    async def _ticker(self) -> None:
        while not self._stopped:
            await self.host.sleep(self.cfg.tick_s)
            healthy_n = waiting_n = 0
            for s in self.sessions.values():
                if s.healthy:
                    healthy_n += 1
                    waiting_n += s.waiting
            self._healthy_n, self._waiting_n = healthy_n, waiting_n
            self._form_blocked = False
            self._evaluate(from_tick=True)
            self._release_drainers()

    def _evaluate(self, from_tick: bool = False) -> None:
        """Decide the current step's commit and the next quorum.

        Time-based detection runs on the ticker only. A message may trigger a formation attempt
        (the fast path when the last worker asks), but once one came back without forming, further
        messages wait for the next tick: thousands of workers asking while a formation waits on a
        timeout would otherwise cost O(workers) each, O(workers^2) per step.
        """
        if self._stopped:
            return
        now = self.host.now()
        if from_tick:
            self._detect(now)
        q = self.quorum
        if q is not None and not q.decided:
            live = [w for w in q.members if self.sessions[w].healthy]
            verdict, why = decide_commit(q.members, live, q.reports, self._needs_coverage)
            if verdict is Verdict.COMMIT:
                self._commit(q, now, why)
            elif verdict is Verdict.ABORT:
                self._abort(q, why)
        if (self.quorum is None or self.quorum.decided) and (from_tick or not self._form_blocked):
            before = self.quorum
            self._maybe_form(now)
            # Block only an attempt that had askers and still waited (a timeout, the job-start
            # window). One that found nobody asking (the commit that just ended a step) must not:
            # the last worker's request would then wait up to tick_s for the ticker, every step.
            if self.quorum is before and self._waiting_n > 0:
                self._form_blocked = True

    @property
    def _needs_coverage(self) -> bool:
        return self.cfg.modes.mode is not ConsistencyMode.LOCAL_SGD

    def _shard_weights(self, members: tuple[str, ...]) -> list[float]:
        """Available mode: shares proportional to measured speed (unmeasured members get the mean)."""
        if self.cfg.modes.mode is not ConsistencyMode.AVAILABLE:
            return []
        known = [self._speed[w] for w in members if w in self._speed]
        if not known:
            return [1.0 / len(members)] * len(members)
        mean = sum(known) / len(known)
        raw = [self._speed.get(w, mean) for w in members]
        total = sum(raw)
        return [r / total for r in raw]

    def _detect(self, now: float) -> None:
        # Only sessions that could be suspects go to the pure decision (cheap pre-filter at scale).
        stale_before = now - self.cfg.detector.heartbeat_timeout_s
        alive = {w: fd.Liveness(s.connected, s.last_heartbeat_s) for w, s in self.sessions.items()
                 if s.healthy and (s.last_heartbeat_s < stale_before or not s.connected)}
        for sus in fd.heartbeat_suspects(now, alive, self.cfg.detector):
            self._suspect(self.sessions[sus.worker_id], sus.reason)
        q = self.quorum
        if q is not None and not q.decided:
            phases = {w: self.sessions[w].phase for w in q.members if self.sessions[w].healthy}
            for sus in fd.progress_suspects(now, phases, self.cfg.detector):
                self._suspect(self.sessions[sus.worker_id], sus.reason)

    def _suspect(self, s: WorkerSession, reason: str) -> None:
        if s.suspected or s.done or self._stopped:
            return
        if s.waiting:
            self._waiting_n -= 1
        s.asked_when_suspected = s.waiting
        s.suspected, s.waiting = reason, False
        self.emit("worker_suspected", worker=s.worker_id, reason=reason)
        q = self.quorum
        if q is not None and s.worker_id in q.member_set:
            q.intact = False
            if not q.decided:
                live = [w for w in q.members if self.sessions[w].healthy]
                verdict, why = decide_commit(q.members, live, q.reports, self._needs_coverage)
                if verdict is Verdict.COMMIT:
                    self._commit(q, self.host.now(), why)
                else:
                    self._abort(q, f"{s.worker_id} lost ({reason})")

    def _commit(self, q: CurrentQuorum, now: float, why: str) -> None:
        assert not q.decided and q.step == self.cluster_step + 1, "a step commits once, in order"
        q.decided = True
        loss = next(iter(q.losses[w] for w in sorted(q.losses)), 0.0)
        covered = bool(q.reports) and all(r.covered_once for r in q.reports.values())
        rec = CommitRecord(q.step, q.quorum_id, q.members, loss, round(now - self._t0, 6),
                           round(now - self._last_commit_s, 6), covered)
        self.commits.append(rec)
        self.cluster_step = q.step
        self._last_commit_s = now
        # recorded (the launcher's durable floor) before any decision leaves the process
        self.emit("step_committed", step=q.step, quorum_id=q.quorum_id, members=list(q.members), loss=loss,
                  step_s=rec.step_s)
        for w in sorted(q.reports):
            s = self.sessions[w]
            s.last_committed_step, s.has_state = q.step, True
            self._send(s, StepDecision(step=q.step, quorum_id=q.quorum_id, commit=True,
                                                             reason=why, loss=loss))

    def _abort(self, q: CurrentQuorum, why: str) -> None:
        q.decided, q.intact = True, False
        self.steps_retried += 1
        for w in q.members:
            s = self.sessions[w]
            if s.connected:
                self._send(s, QuorumBroken(quorum_id=q.quorum_id, reason=why))
                self._send(s, StepDecision(step=q.step, quorum_id=q.quorum_id, commit=False,
                                                                 reason=why))
        self.emit("step_aborted", step=q.step, quorum_id=q.quorum_id, reason=why)

    def _maybe_form(self, now: float) -> None:
        finished = self._job_finished()
        if finished and not any(s.healthy and s.waiting for s in self.sessions.values()):
            return  # after the last step only a late worker asking to catch up needs a quorum
        views = [self._member_view(s, finished) for s in self._sorted_sessions()]
        q = self.quorum
        view = QuorumView(self.cluster_step, q.quorum_id if q else 0, q.members if q else (),
                          bool(q and q.intact), self.checkpoint[1], self.checkpoint[0], self.max_id_seen,
                          self._awaiting_holders(now))
        # once the job is over a late worker adopts the final state, in every mode (local-sgd too:
        # it does not merge its stale parameters into a finished job)
        qcfg = replace(self.cfg.quorum, merge_stale=False) if finished else self.cfg.quorum
        d = decide_quorum(now, views, view, qcfg)
        if d.action is Action.STALL and finished:
            self._release_late_workers(d.reason)
            return
        if d.action is Action.STALL:
            if self.stall_reason != d.reason:
                self.stall_reason = d.reason
                self.emit("quorum_stalled", reason=d.reason)
                self.stalled.set()
            return
        if d.action is not Action.FORM:
            return
        self.stall_reason = ""
        assert q is None or d.quorum_id >= q.quorum_id, "quorum ids never decrease"
        weights = self._shard_weights(d.members)
        self.quorum = CurrentQuorum(d.quorum_id, d.step, d.members, now, member_set=frozenset(d.members),
                                    weights={w: weights[i] if weights else 1.0 / len(d.members)
                                             for i, w in enumerate(d.members)})
        local_step = max(self.sessions[w].requested_step for w in d.members)
        self.max_id_seen = max(self.max_id_seen, d.quorum_id)
        writer = "" if finished else self._checkpoint_writer(d, local_step)
        self._waiting_n = max(0, self._waiting_n - sum(1 for w in d.members if not self.sessions[w].done))
        heal_targets: dict[str, list[str]] = {}
        for t in sorted(d.heal_from):
            heal_targets.setdefault(d.heal_from[t], []).append(t)
        for rank, w in enumerate(d.members):
            s = self.sessions[w]
            s.waiting, s.phase = False, (fd.Phase.ASSIGNED, now)
            src = d.heal_from.get(w, "")
            msg = QuorumAssigned(step=d.step, quorum_id=d.quorum_id, members=list(d.members), rank=rank,
                                 heal_from=src, heal_address=self.sessions[src].heal_address if src else "",
                                 heal_targets=heal_targets.get(w, []),
                                 restore_checkpoint=d.restore_checkpoint, write_checkpoint=(w == writer),
                                 shard_weights=weights, local_step=local_step, catch_up=finished)
            self._send(s, msg)
        if not (q and q.quorum_id == d.quorum_id):
            self.emit("quorum_formed", quorum_id=d.quorum_id, step=d.step, members=list(d.members), reason=d.reason)
        if finished:
            # A catch-up after the last step: late members restore or heal from a worker that holds
            # the final state (one still draining); there is nothing to compute or commit.
            self.quorum.decided = True
            self.emit("caught_up_after_finish", members=list(d.members), step=self.cluster_step)

    def _member_view(self, s: WorkerSession, finished: bool) -> MemberView:
        if finished and s.holds_final and s.connected:
            # a drainer: it said Goodbye holding the final state and can serve it to a late worker
            return MemberView(s.worker_id, True, True, s.waiting_since_s, s.last_committed_step, True, s.joined_at_s)
        return MemberView(s.worker_id, s.healthy, s.waiting, s.waiting_since_s, s.last_committed_step,
                          s.has_state, s.joined_at_s)

    def _release_drainers(self) -> None:
        """Workers that finished wait (up to ``drain_s``) to heal a late peer. Once every worker
        has said Goodbye, none can still need the final state: they may leave at once. (A worker
        that is behind, frozen, or killed and maybe restarting keeps them, for at most drain_s.)"""
        drainers = [s for s in self._sorted_sessions() if s.holds_final and s.connected and not s.released]
        if not drainers or not all(s.done for s in self.sessions.values()):
            return
        for s in drainers:
            s.released = True
            self._send(s, Shutdown(reason="job finished: no worker needs the final state any more"))

    def _job_finished(self) -> bool:
        if self.cfg.modes.mode is ConsistencyMode.LOCAL_SGD:
            return self.completed_workers > 0  # its steps are local: a worker that finished ends the job
        return self.total_steps > 0 and self.cluster_step >= self.total_steps - 1

    def _release_late_workers(self, why: str) -> None:
        """The job's last step is committed, but these workers are behind and nothing can catch them
        up (no checkpoint of the final step): they stop without the final state, and say so."""
        for s in self._sorted_sessions():
            if s.healthy and s.waiting:
                s.waiting = False
                self._waiting_n -= 1
                self._send(s, Shutdown(reason=f"the job finished at step {self.cluster_step} while this worker "
                                              f"was behind, and {why.split(';')[0]}"))
                self.emit("late_worker_released", worker=s.worker_id, last_committed_step=s.last_committed_step)

    def _checkpoint_writer(self, d: Any, local_step: int) -> str:
        """Who writes a durable checkpoint after this step: every K steps, and always after the
        job's last step when the run has a directory (a worker that wakes after every peer has
        left restores the final state from it)."""
        k = self.cfg.checkpoint_every_steps
        if self.cfg.modes.mode is ConsistencyMode.LOCAL_SGD:
            final = self.total_steps > 0 and local_step >= self.total_steps
        else:
            final = self.total_steps > 0 and d.step == self.total_steps - 1
        periodic = k > 0 and (d.step + 1) % k == 0
        if not (periodic or (final and (k > 0 or self.cfg.run_dir))):
            return ""
        return next((w for w in d.members if w not in d.heal_from), d.members[0])

    # ---- used by launchers and the simulator ----
    async def inject(self, worker_id: str, fault: InjectFault) -> bool:
        s = self.sessions.get(worker_id)
        if s is None or not s.connected:
            return False
        self._send(s, fault)
        return True

    def note_checkpoint(self, path: str, step: int) -> None:
        if step > self.checkpoint[1]:
            self.checkpoint = (path, step)


async def _send_quiet(conn: Connection, message: Any) -> None:
    try:
        await conn.send(message)
    except TransportError:
        pass  # the connection's loss is noticed by its reader


async def _refuse(conn: Connection, reason: str) -> None:
    await _send_quiet(conn, Refused(reason=reason))
    conn.close(reason)
