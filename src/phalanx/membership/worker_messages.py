"""The coordinator's side of a worker connection: admission (Hello -> Welcome or Refused), then
one short method per message kind, each validating what it is told (an authenticated worker may
still be buggy or older) and returning whether a decision may now be due. Mixed into
:class:`phalanx.membership.coordinator.Coordinator`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from phalanx.core.errors import TransportError
from phalanx.core.host import Connection
from phalanx.core.messages import (
    AllreduceDone, CheckpointUnusable, CheckpointWritten, Goodbye, HealDone, Heartbeat, Hello, Progress,
    QuorumCancel, QuorumRequest, Refused, StepDecision, Welcome,
)
from phalanx.membership import failure_detector as fd
from phalanx.membership import policy
from phalanx.membership.coordinator_state import ID_LIMIT
from phalanx.membership.quorum import Report
from phalanx.membership.sessions import SuspicionCause, WorkerSession

if TYPE_CHECKING:
    from phalanx.core.host import Host
    from phalanx.membership.coordinator_state import CoordinatorConfig, CurrentQuorum
    from phalanx.membership.outbox import Outboxes
    from phalanx.membership.sessions import Sessions


class WorkerMessages:
    # provided by Coordinator
    host: "Host"
    cfg: "CoordinatorConfig"
    sessions: "Sessions"
    quorum: "CurrentQuorum | None"
    cluster_step: int
    max_id_seen: int
    total_steps: int
    completed_workers: int
    formed_any: bool
    refused: dict[str, int]
    quorum_requests: dict[str, int]
    all_done: Any
    _form_blocked: bool
    _speed: dict[str, float]
    emit: Callable[..., None]
    note_checkpoint: Callable[[str, int], None]
    _evaluate: Callable[..., None]
    _release_drainers: Callable[[], None]
    _suspect: Callable[[WorkerSession, SuspicionCause, str], None]
    _tick_soon: Callable[[], None]
    _alarm: Any
    _outboxes: "Outboxes"
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
        self._send(session, self._welcome())
        self._outboxes.flush()
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
                  heal_address=hello.heal_address,
                  last_committed_step=hello.last_committed_step)
        return session

    def _send(self, s: WorkerSession, message: Any) -> None:
        """Queue a message for one worker (membership/outbox.py: written in order, at the end of the
        message being handled or on the loop's next turn; a worker not reading loses its connection)."""
        self._outboxes.queue(s, message)

    # ---- messages: one short method each ----
    def _handle(self, s: WorkerSession, m: Any) -> None:
        handler = self._HANDLERS.get(type(m))
        if handler is None:
            self._refuse_message(s, type(m).__name__, "not a message a worker sends")
            return
        self._heard_from(s)
        if handler(self, s, m):
            self._evaluate()
        self._outboxes.flush()  # what this message decided leaves before the next is read

    def _heard_from(self, s: WorkerSession) -> None:
        """Any message from a worker is a sign of life (workers skip heartbeats while other
        messages flow), and clears a suspicion of silence."""
        s.last_heartbeat_s = self.host.now()
        if s.cause is SuspicionCause.NO_HEARTBEAT:
            self.emit("worker_alive_again", worker=s.worker_id, was=s.suspected)
            # Found by the simulator: it asked, was suspected before any answer, and kept waiting
            # for one; without this it sat outside every quorum until the job ended.
            self.sessions.clear_suspicion(s, self.host.now())

    def _on_heartbeat(self, s: WorkerSession, m: Heartbeat) -> bool:
        return False  # its sign of life is taken in _handle, as every message's

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
        self.quorum_requests["sent"] += 1
        s.last_committed_step, s.has_state = m.last_committed_step, m.has_state
        s.requested_step = m.step
        self.total_steps = max(self.total_steps, min(m.total_steps, ID_LIMIT))
        s.phase = (fd.Phase.REQUESTED, now)
        if not self.sessions.everyone_asking():
            self._tick_soon()  # the last request or, on a timeout, the ticker decides (O(1) here)
            return False
        self._form_blocked = False  # the request that completes the askers always tries to form
        return True

    def _asked_in_report(self, s: WorkerSession, step: int, now: float) -> None:
        """The fast path: a member of the step that just committed asked for the next one in its
        report. It holds the step it reported (the commit says so), so this is exactly the
        QuorumRequest it would send next, without the round trip."""
        s.asks_next = -1
        if s.done or not s.healthy:
            return
        self.sessions.set_waiting(s, True, now)
        self.quorum_requests["in_reports"] += 1
        s.requested_step = step
        s.phase = (fd.Phase.REQUESTED, now)

    def _on_quorum_cancel(self, s: WorkerSession, m: QuorumCancel) -> bool:
        s.asked_when_suspected = False
        self.sessions.set_waiting(s, False)
        return False

    def _on_progress(self, s: WorkerSession, m: Progress) -> bool:
        q = self.quorum
        # phases only move forward: the mark is sent without waiting, and may trail the report
        if q and m.quorum_id == q.quorum_id and m.step == q.step and s.worker_id in q.member_set \
                and s.phase[0] < fd.Phase.ALLREDUCE:
            # backdated to when the worker entered the phase (the mark is sent only once it lasts),
            # never before the phase it leaves began
            s.phase = (fd.Phase.ALLREDUCE, max(s.phase[1], self.host.now() - m.age_s))
            # backdated: the progress watch may be due before the time the ticker last computed
            self._alarm.ring_by(fd.progress_deadline_s(s.phase[1], self.cfg.detector))
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
        return False  # matters for the next formation only: a waiting one is re-tried every tick_s

    def _on_checkpoint_written(self, s: WorkerSession, m: CheckpointWritten) -> bool:
        if not 0 <= m.step <= self.cluster_step or not m.path:
            self._refuse_message(s, "CheckpointWritten", f"step {m.step} is not a committed step "
                                                         f"(the cluster is at {self.cluster_step})")
            return False
        self.note_checkpoint(m.path, m.step)
        self.emit("checkpoint_written", worker=s.worker_id, step=m.step, path=m.path)
        return False  # may unblock a stalled formation: a waiting one is re-tried every tick_s

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
        if m.completed:
            self._tick_soon()  # the job drains: its finished workers are released on a tick
        if m.completed and s.has_state:
            s.holds_final, s.last_committed_step = True, min(m.final_step, self.cluster_step)
        self.emit("worker_finished", worker=s.worker_id, completed=m.completed, reason=m.reason)
        if all(x.done for x in self.sessions.values()):
            self.all_done.set()
        self._release_drainers()
        q = self.quorum
        return not (q is None or q.decided or s.worker_id not in q.member_set)

    _HANDLERS: dict[type, Callable[[Any, WorkerSession, Any], bool]] = {
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
        s.asks_next = m.next_step if m.ok and m.next_step == q.step + 1 else -1
        q.losses[s.worker_id] = m.loss
        speed = policy.updated_speed(self._speed.get(s.worker_id), q.weights.get(s.worker_id, 0.0) if m.ok else 0.0,
                                     m.compute_s)
        if speed is not None:
            self._speed[s.worker_id] = speed
        s.phase = (fd.Phase.REPORTED, self.host.now())


async def _send_quiet(conn: Connection, message: Any) -> None:
    try:
        await conn.send(message)
    except TransportError:
        pass  # the connection's loss is noticed by its reader


async def _refuse(conn: Connection, reason: str) -> None:
    await _send_quiet(conn, Refused(reason=reason))
    conn.close(reason)
