"""The coordinator: membership, failure detection, per-step quorum and commit decisions.

Asyncio code behind the Host seam; the same class runs embedded in ``phalanx launch``, standalone
in ``phalanx coordinator`` and, on simulated transport and clock, in the simulator. It is a driver:
decisions are the pure functions of :mod:`quorum`, :mod:`failure_detector` and :mod:`policy`;
sessions and their counts live in :mod:`sessions`; this module does the I/O and validates what
workers claim (an authenticated but buggy or older worker is refused, never trusted).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from phalanx.core.errors import TransportError
from phalanx.core.host import Connection, Host
from phalanx.core.messages import (
    AllreduceDone, CheckpointUnusable, CheckpointWritten, Goodbye, HealDone, Heartbeat, Hello, InjectFault, Progress,
    QuorumAssigned, QuorumBroken, QuorumCancel, QuorumRequest, Refused, Shutdown, StepDecision, Welcome,
)
from phalanx.core.modes import ConsistencyMode, ModeConfig
from phalanx.membership import failure_detector as fd
from phalanx.membership import policy
from phalanx.membership.quorum import (
    Action, MemberView, QuorumConfig, QuorumDecision, QuorumView, Report, Verdict, decide_commit, decide_quorum,
)
from phalanx.membership.sessions import Sessions, SuspicionCause, WorkerSession

__all__ = ["Coordinator", "CoordinatorConfig", "CommitRecord", "WorkerSession", "apply_mode"]

ID_LIMIT = 2**62  # quorum ids and steps stay far below the codec's 64-bit integers
EVENTS_KEPT = 10_000  # in memory; the launcher streams every event to events.jsonl


@dataclass(frozen=True)
class CoordinatorConfig:
    detector: fd.DetectorConfig = fd.DetectorConfig()
    quorum: QuorumConfig = QuorumConfig()
    collective_timeout_s: float = 5.0
    checkpoint_every_steps: int = 0
    tick_s: float = 0.02
    run_dir: str = ""  # "" = no durable storage: the last step is not checkpointed
    run_id: str = "run"
    modes: ModeConfig = ModeConfig()
    # how long a worker that finished holding the final state stays to heal a late peer (a frozen
    # worker that wakes after the last step); released at once when every worker said Goodbye
    drain_s: float = 5.0
    sessions_max: int = 4096  # distinct worker ids; a Hello beyond it is refused
    session_keep_s: float = 60.0  # a departed, finished session is forgotten this long after it left


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
        self.sessions = Sessions()
        self.quorum: CurrentQuorum | None = None
        self.cluster_step = resume[1] if resume else -1
        self.checkpoint: tuple[str, int] = resume if resume else ("", -1)
        self.max_id_seen = 0
        self.commits: list[CommitRecord] = []
        self.steps_retried = 0
        self.stall_reason = ""
        self.total_steps = -1  # the loop's length as workers report it (-1: unknown)
        self.completed_workers = 0  # workers that said Goodbye holding the final state
        self.formed_any = False  # this incarnation formed a quorum: it knows every step and id since
        self._form_blocked = False  # a message-triggered formation found nothing to form this tick
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self.refused: dict[str, int] = {}  # messages refused, by kind (events for the first few)
        self._speed: dict[str, float] = {}  # available mode: share of the batch per compute second
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
        for s in self.sessions.values():
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
        sessions, self.sessions, self.quorum = self.sessions.values(), Sessions(), None
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

    def _refuse_message(self, s: WorkerSession, kind: str, why: str) -> None:
        """An authenticated worker sent something that cannot be true: ignore it, keep running,
        and say so (the first few of each kind as events, then only the count)."""
        n = self.refused[kind] = self.refused.get(kind, 0) + 1
        if n <= 5 or n % 1000 == 0:
            self.emit("message_refused", worker=s.worker_id, kind=kind, reason=why, count=n)

    # ---- connections ----
    async def _serve(self, conn: Connection) -> None:
        try:
            first, _ = await conn.recv()
        except TransportError:
            return
        if not isinstance(first, Hello):
            await _refuse(conn, f"expected Hello, got {type(first).__name__}")
            return
        why = self._hello_refusal(first)
        if why:
            self.emit("worker_refused", worker=first.worker_id, reason=why)
            await _refuse(conn, why)
            return
        session = self._admit(first, conn)
        self.host.spawn(self._sender(session), f"send-{session.worker_id}")
        await _send_quiet(conn, self._welcome())
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
                self.sessions.disconnect(session, self.host.now())
                if not session.done:  # decides the current step if it must
                    self._suspect(session, SuspicionCause.CONNECTION_LOST, "connection lost")

    def _welcome(self) -> Welcome:
        m = self.cfg.modes
        return Welcome(run_id=self.cfg.run_id, store_address=self.store_address,
                       heartbeat_interval_s=self.cfg.detector.heartbeat_interval_s,
                       collective_timeout_s=self.cfg.collective_timeout_s,
                       checkpoint_every_steps=self.cfg.checkpoint_every_steps, run_dir=self.cfg.run_dir,
                       mode=m.mode.value, deadline_s=m.deadline_s, sync_every_steps=m.sync_every_steps,
                       max_staleness_steps=m.max_staleness_steps, sync_timeout_s=m.sync_timeout_s,
                       drain_s=self.cfg.drain_s)

    def _hello_refusal(self, hello: Hello) -> str:
        if hello.worker_id not in self.sessions and len(self.sessions) >= self.cfg.sessions_max:
            return f"the coordinator already tracks {self.cfg.sessions_max} workers (sessions_max)"
        step = hello.last_committed_step if hello.has_state else -1
        return policy.hello_refusal(step, hello.max_quorum_id_seen, self.formed_any, self.cluster_step,
                                    self.max_id_seen, ID_LIMIT)

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
        missing, expired = policy.awaiting_holders(now - self._t0, self.cfg.quorum.rejoin_wait_s, members,
                                                   self.sessions)
        if not missing or expired:
            self._floor_commit = None  # every member said Hello (one holding the step raised it), or too late
            if expired:
                self.emit("rejoin_wait_expired", step=step, missing=list(missing))
            return ()
        return missing

    def _admit(self, hello: Hello, conn: Connection) -> WorkerSession:
        now = self.host.now()
        old = self.sessions.get(hello.worker_id)
        if old is not None and old.connected:
            old.conn.close("replaced by a new incarnation")
            if old.healthy:
                self._suspect(old, SuspicionCause.REPLACED, "replaced by a new incarnation")
        self.max_id_seen = max(self.max_id_seen, hello.max_quorum_id_seen)
        if hello.has_state:
            self.cluster_step = max(self.cluster_step, hello.last_committed_step)
        session = WorkerSession(hello.worker_id, hello.incarnation, conn, hello.pid, hello.heal_address,
                                now, now, hello.last_committed_step, hello.has_state)
        self.sessions.admit(session)
        self.emit("worker_joined", worker=hello.worker_id, pid=hello.pid, incarnation=hello.incarnation,
                  last_committed_step=hello.last_committed_step)
        return session

    # ---- messages: one short method each ----
    def _handle(self, s: WorkerSession, m: Any) -> None:
        handler = self._HANDLERS.get(type(m))
        if handler is None:
            self._refuse_message(s, type(m).__name__, "not a message a worker sends")
            return
        if handler(self, s, m):
            self._evaluate()

    def _on_heartbeat(self, s: WorkerSession, m: Heartbeat) -> bool:
        s.last_heartbeat_s = self.host.now()
        if s.cause is SuspicionCause.NO_HEARTBEAT:
            self.emit("worker_alive_again", worker=s.worker_id, was=s.suspected)
            # Found by the simulator: it asked, was suspected before any answer, and kept waiting
            # for one; without this it sat outside every quorum until the job ended.
            self.sessions.clear_suspicion(s, self.host.now())
        return False

    def _on_quorum_request(self, s: WorkerSession, m: QuorumRequest) -> bool:
        now = self.host.now()
        if s.done:
            self._refuse_message(s, "QuorumRequest", "the worker already said Goodbye")
            return False
        if s.cause is SuspicionCause.NO_PROGRESS:
            self.emit("worker_alive_again", worker=s.worker_id, was=s.suspected)
            self.sessions.clear_suspicion(s, now)
        if s.has_state and m.last_committed_step > self.cluster_step and self.formed_any:
            self._refuse_message(s, "QuorumRequest", f"claims step {m.last_committed_step} beyond the cluster's "
                                                     f"{self.cluster_step}")
            return False
        self.sessions.set_waiting(s, True, now)
        s.last_committed_step, s.has_state = m.last_committed_step, m.has_state
        s.requested_step = m.step
        self.total_steps = max(self.total_steps, min(m.total_steps, ID_LIMIT))
        s.phase = (fd.Phase.REQUESTED, now)
        if not self.sessions.everyone_asking():
            return False  # others are still to ask: the ticker or the last request decides (O(1) here)
        self._form_blocked = False  # the request that completes the askers always tries to form
        return True

    def _on_quorum_cancel(self, s: WorkerSession, m: QuorumCancel) -> bool:
        s.asked_when_suspected = False
        self.sessions.set_waiting(s, False)
        return False

    def _on_progress(self, s: WorkerSession, m: Progress) -> bool:
        q = self.quorum
        if q and m.quorum_id == q.quorum_id and s.worker_id in q.member_set:
            s.phase = (fd.Phase.ALLREDUCE, self.host.now())
        return False

    def _on_allreduce_done(self, s: WorkerSession, m: AllreduceDone) -> bool:
        self._on_report(s, m)
        q = self.quorum
        # a commit needs every live member; losses are handled where they are noticed
        return not (q is not None and m.ok and not q.decided and len(q.reports) < len(q.members))

    def _on_heal_done(self, s: WorkerSession, m: HealDone) -> bool:
        if m.quorum_id > self.max_id_seen or not 0 <= m.step <= self.cluster_step + 1:
            self._refuse_message(s, "HealDone", f"healed to step {m.step} in quorum {m.quorum_id}, which this "
                                                "coordinator never formed")
            return False
        s.has_state, s.last_committed_step = True, m.step - 1
        self.emit("worker_healed", worker=s.worker_id, source=m.source, step=m.step, quorum_id=m.quorum_id)
        return False  # matters for the next formation only: the ticker takes it from here

    def _on_checkpoint_written(self, s: WorkerSession, m: CheckpointWritten) -> bool:
        if not 0 <= m.step <= self.cluster_step or not m.path:
            self._refuse_message(s, "CheckpointWritten", f"step {m.step} is not a committed step "
                                                         f"(the cluster is at {self.cluster_step})")
            return False
        self.note_checkpoint(m.path, m.step)
        self.emit("checkpoint_written", worker=s.worker_id, step=m.step, path=m.path)
        return False  # may unblock a stalled formation: the ticker re-evaluates within tick_s

    def _on_checkpoint_unusable(self, s: WorkerSession, m: CheckpointUnusable) -> bool:
        if m.path == self.checkpoint[0]:
            self.emit("checkpoint_unusable", worker=s.worker_id, path=m.path, reason=m.reason)
            self.checkpoint = ("", -1)  # not offered again: the formation stalls with a clear reason
        return False

    def _on_goodbye(self, s: WorkerSession, m: Goodbye) -> bool:
        if s.done:
            return False
        self.sessions.finish(s)
        self.completed_workers += int(m.completed)
        if m.completed and s.has_state:
            s.holds_final, s.last_committed_step = True, min(m.final_step, self.cluster_step)
        self.emit("worker_finished", worker=s.worker_id, completed=m.completed, reason=m.reason)
        if all(x.done for x in self.sessions.values()):
            self.all_done.set()
        self._release_drainers()
        q = self.quorum
        return not (q is None or q.decided or s.worker_id not in q.member_set)

    _HANDLERS: dict[type, Callable[["Coordinator", WorkerSession, Any], bool]] = {
        Heartbeat: _on_heartbeat, QuorumRequest: _on_quorum_request, QuorumCancel: _on_quorum_cancel,
        Progress: _on_progress, AllreduceDone: _on_allreduce_done, HealDone: _on_heal_done,
        CheckpointWritten: _on_checkpoint_written, CheckpointUnusable: _on_checkpoint_unusable,
        Goodbye: _on_goodbye,
    }

    def _on_report(self, s: WorkerSession, m: AllreduceDone) -> None:
        q = self.quorum
        if q is None or m.quorum_id != q.quorum_id or m.step != q.step or q.decided or s.worker_id not in q.member_set:
            # Fencing: an outcome from an older epoch never counts; tell the sender to roll back.
            self._send(s, StepDecision(step=m.step, quorum_id=m.quorum_id, commit=False,
                                       reason="stale quorum id: step fenced"))
            return
        q.reports[s.worker_id] = Report(m.ok, m.samples_covered_once, m.error)
        q.losses[s.worker_id] = m.loss
        speed = policy.updated_speed(self._speed.get(s.worker_id), q.weights.get(s.worker_id, 0.0) if m.ok else 0.0,
                                     m.compute_s)
        if speed is not None:
            self._speed[s.worker_id] = speed
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
            if self._stopped:
                return
            self.sessions.check_counts()
            self._form_blocked = False
            self._evaluate(from_tick=True)
            self._release_drainers()
            q = self.quorum
            self.sessions.prune(self.host.now(), self.cfg.session_keep_s,
                                q.member_set if q is not None and not q.decided else frozenset())

    def _evaluate(self, from_tick: bool = False) -> None:
        """Decide the current step's commit and the next quorum.

        Time-based detection runs on the ticker only. A message may trigger a formation attempt
        (the fast path when the last worker asks), but once one came back without forming, further
        messages wait for the next tick: thousands of workers asking while a formation waits on a
        timeout would otherwise cost O(workers) each, O(workers^2) per step. The request that
        completes the set of askers clears the block (``_on_quorum_request``).
        """
        if self._stopped:
            return
        now = self.host.now()
        if from_tick:
            self._detect(now)
        q = self.quorum
        if q is not None and not q.decided:
            self._decide(q, now)
        if (self.quorum is None or self.quorum.decided) and (from_tick or not self._form_blocked):
            before = self.quorum
            self._maybe_form(now)
            # Block only an attempt that had askers and still waited (a timeout, the job-start
            # window). One that found nobody asking (the commit that just ended a step) must not.
            if self.quorum is before and self.sessions.waiting_n > 0:
                self._form_blocked = True

    def _decide(self, q: CurrentQuorum, now: float) -> None:
        live = [w for w in q.members if self.sessions[w].healthy]
        verdict, why = decide_commit(q.members, live, q.reports, self._needs_coverage)
        if verdict is Verdict.COMMIT:
            self._commit(q, now, why)
        elif verdict is Verdict.ABORT:
            self._abort(q, why)

    @property
    def _needs_coverage(self) -> bool:
        return self.cfg.modes.mode is not ConsistencyMode.LOCAL_SGD

    def _detect(self, now: float) -> None:
        # Only sessions that could be suspects go to the pure decision (cheap pre-filter at scale).
        stale_before = now - self.cfg.detector.heartbeat_timeout_s
        alive = {s.worker_id: fd.Liveness(s.connected, s.last_heartbeat_s) for s in self.sessions.unordered()
                 if s.healthy and (s.last_heartbeat_s < stale_before or not s.connected)}
        for sus in fd.heartbeat_suspects(now, alive, self.cfg.detector):
            cause = SuspicionCause.CONNECTION_LOST if not alive[sus.worker_id].connected else SuspicionCause.NO_HEARTBEAT
            self._suspect(self.sessions[sus.worker_id], cause, sus.reason)
        q = self.quorum
        if q is not None and not q.decided:
            phases = {w: self.sessions[w].phase for w in q.members if self.sessions[w].healthy}
            for sus in fd.progress_suspects(now, phases, self.cfg.detector):
                self._suspect(self.sessions[sus.worker_id], SuspicionCause.NO_PROGRESS, sus.reason)

    def _suspect(self, s: WorkerSession, cause: SuspicionCause, reason: str) -> None:
        if self._stopped or not self.sessions.suspect(s, cause, reason):
            return
        self.emit("worker_suspected", worker=s.worker_id, reason=reason, cause=cause.name.lower())
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
            self._send(s, StepDecision(step=q.step, quorum_id=q.quorum_id, commit=True, reason=why, loss=loss))

    def _abort(self, q: CurrentQuorum, why: str) -> None:
        q.decided, q.intact = True, False
        self.steps_retried += 1
        for w in q.members:
            s = self.sessions[w]
            if s.connected:
                self._send(s, QuorumBroken(quorum_id=q.quorum_id, reason=why))
                self._send(s, StepDecision(step=q.step, quorum_id=q.quorum_id, commit=False, reason=why))
        self.emit("step_aborted", step=q.step, quorum_id=q.quorum_id, reason=why)

    # ---- forming the next quorum ----
    def _job_finished(self) -> bool:
        return policy.job_finished(self.cfg.modes.mode, self.total_steps, self.cluster_step, self.completed_workers)

    def _maybe_form(self, now: float) -> None:
        finished = self._job_finished()
        if finished and self.sessions.waiting_n == 0:
            return  # after the last step only a late worker asking to catch up needs a quorum
        views = [self._member_view(s, finished) for s in self.sessions.values()]
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
        elif d.action is Action.STALL:
            if self.stall_reason != d.reason:
                self.stall_reason = d.reason
                self.emit("quorum_stalled", reason=d.reason)
                self.stalled.set()
        elif d.action is Action.FORM:
            self._form(d, now, finished)

    def _form(self, d: QuorumDecision, now: float, finished: bool) -> None:
        q = self.quorum
        self.stall_reason = ""
        assert q is None or d.quorum_id >= q.quorum_id, "quorum ids never decrease"
        weights = policy.shard_weights(self.cfg.modes.mode, d.members, self._speed)
        self.quorum = CurrentQuorum(d.quorum_id, d.step, d.members, now, member_set=frozenset(d.members),
                                    weights={w: weights[i] if weights else 1.0 / len(d.members)
                                             for i, w in enumerate(d.members)})
        self.formed_any = True
        local_step = max(self.sessions[w].requested_step for w in d.members)
        self.max_id_seen = max(self.max_id_seen, d.quorum_id)
        writer = "" if finished else policy.checkpoint_writer(
            policy.CheckpointPolicy(self.cfg.checkpoint_every_steps, bool(self.cfg.run_dir)), self.cfg.modes.mode,
            self.total_steps, d.step, local_step, d.members, d.heal_from)
        heal_targets: dict[str, list[str]] = {}
        for t in sorted(d.heal_from):
            heal_targets.setdefault(d.heal_from[t], []).append(t)
        for rank, w in enumerate(d.members):
            s = self.sessions[w]
            self.sessions.set_waiting(s, False)
            s.phase = (fd.Phase.ASSIGNED, now)
            src = d.heal_from.get(w, "")
            self._send(s, QuorumAssigned(
                step=d.step, quorum_id=d.quorum_id, members=list(d.members), rank=rank, heal_from=src,
                heal_address=self.sessions[src].heal_address if src else "", heal_targets=heal_targets.get(w, []),
                restore_checkpoint=d.restore_checkpoint, write_checkpoint=(w == writer), shard_weights=weights,
                local_step=local_step, catch_up=finished))
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
        if self.completed_workers == 0:
            return
        sessions = self.sessions.values()
        drainers = [s for s in sessions if s.holds_final and s.connected and not s.released]
        if not drainers or not all(s.done for s in sessions):
            return
        for s in drainers:
            s.released = True
            self._send(s, Shutdown(reason="job finished: no worker needs the final state any more"))

    def _release_late_workers(self, why: str) -> None:
        """The job's last step is committed, but these workers are behind and nothing can catch them
        up (no worker holding the final state is left, no checkpoint of it): they stop without the
        final state, and say so."""
        for s in self.sessions.values():
            if s.healthy and s.waiting:
                self.sessions.set_waiting(s, False)
                self._send(s, Shutdown(reason=f"the job finished at step {self.cluster_step} while this worker "
                                              f"was behind, and {why.split(';')[0]}"))
                self.emit("late_worker_released", worker=s.worker_id, last_committed_step=s.last_committed_step)

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
