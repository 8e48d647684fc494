"""The coordinator: membership, failure detection, per-step quorum and commit decisions.

Asyncio code behind the Host seam; the same class runs embedded in ``phalanx launch``, standalone
in ``phalanx coordinator`` and, on simulated transport and clock, in the simulator. It is a driver:
decisions are the pure functions of :mod:`quorum`, :mod:`failure_detector` and :mod:`policy`;
sessions and their counts live in :mod:`sessions`; this module does the I/O and validates what
workers claim (an authenticated but buggy or older worker is refused, never trusted).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from phalanx.core.alarm import Alarm
from phalanx.core.errors import TransportError
from phalanx.core.host import Host
from phalanx.core.messages import InjectFault, QuorumAssigned, QuorumBroken, Shutdown, StepDecision
from phalanx.core.modes import ConsistencyMode
from phalanx.membership import failure_detector as fd
from phalanx.membership import policy
from phalanx.membership.coordinator_state import (
    EVENTS_KEPT, CommitRecord, CoordinatorConfig, CurrentQuorum, StepPace, apply_mode,
)
from phalanx.membership.outbox import Outboxes
from phalanx.membership.quorum import (
    Action, MemberView, QuorumDecision, QuorumView, Verdict, decide_commit, decide_quorum,
)
from phalanx.membership.sessions import Sessions, SuspicionCause, WorkerSession
from phalanx.membership.worker_messages import WorkerMessages

__all__ = ["Coordinator", "CoordinatorConfig", "CommitRecord", "WorkerSession", "apply_mode"]

class Coordinator(WorkerMessages):
    def __init__(self, host: Host, cfg: CoordinatorConfig, store_address: str,
                 on_event: Callable[[dict[str, Any]], None] | None = None,
                 resume: tuple[str, int] | None = None,
                 on_commit: Callable[[CommitRecord], None] | None = None) -> None:
        self._pace = StepPace(cfg)  # available mode: the deadline follows the recent step time
        self.host, self.cfg, self.store_address = host, self._pace.before_any_step(), store_address
        self._on_event = on_event
        self._on_commit = on_commit  # gets every commit record, before the decision leaves the process
        self.sessions = Sessions()
        self.quorum: CurrentQuorum | None = None
        self.cluster_step = resume[1] if resume else -1
        self.checkpoint: tuple[str, int] = resume if resume else ("", -1)
        self.max_id_seen = 0
        # the last cfg.commits_kept records only; the full history is the on_commit sink's
        self.commits: deque[CommitRecord] = deque(maxlen=max(1, cfg.commits_kept))
        self.commits_total = self.steps_retried = 0
        self.stall_reason = ""
        self.total_steps = -1  # the loop's length as workers report it (-1: unknown)
        self.completed_workers = 0  # workers that said Goodbye holding the final state
        self.formed_any = False  # this incarnation formed a quorum: it knows every step and id since
        self._form_blocked = False  # a message-triggered formation found nothing to form this tick
        self._late_s = 0.0  # how late the running tick is: the coordinator itself was not running
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self.refused: dict[str, int] = {}  # messages refused, by kind (events for the first few)
        # quorum requests by how they came: a QuorumRequest message, or in a step's report (the fast path)
        self.quorum_requests = {"sent": 0, "in_reports": 0}
        self._speed: dict[str, float] = {}  # available mode: share of the batch per compute second
        self._t0 = self._last_commit_s = host.now()
        self._floor_commit: tuple[int, frozenset[str]] | None = None  # see raise_floor
        self._stopped = False
        self._alarm = Alarm(host)
        self._outboxes = Outboxes(host)
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
        self._alarm.ring_by(-math.inf)  # the ticker ends now, not at its next due time
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
        self._alarm.ring_by(-math.inf)
        self._listener.close()
        sessions, self.sessions, self.quorum = self.sessions.values(), Sessions(), None
        for s in sessions:  # emptied first: the readers' exit paths find no session to suspect or report
            s.connected = False
            s.conn.close()  # the default reason: a crash is not a refused connection
            s.outbox.clear()

    def emit(self, event: str, **fields: Any) -> None:
        record = {"t": round(self.host.now() - self._t0, 6), "node": "coordinator", "event": event, **fields}
        self.events.append(record)
        self.host.log(event, **fields)
        if self._on_event:
            self._on_event(record)

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

    # ---- decisions ----
    async def _ticker(self) -> None:
        """Detection and the time-based parts of formation, run when something can be due (the
        alarm, ``core.alarm``): the quietest worker's heartbeat timeout, the progress watch, and
        every ``tick_s`` only while a formation waits or the job drains. A fault-free cluster
        wakes it about twice a heartbeat timeout, not 50 times a second."""
        alarm, housekeeping_s = self._alarm, self.host.now() + HOUSEKEEPING_S
        while not self._stopped:
            due_s = await alarm.wait()
            if self._stopped:
                return
            now = self.host.now()
            alarm.clear()  # what this tick finds due next, and what rings meanwhile, set the next
            self._form_blocked = False
            self._late_s = fd.own_lateness_s(now, due_s)
            if self._late_s > self.cfg.detector.heartbeat_timeout_s / 2:  # worth a line in the events
                self.emit("coordinator_late", late_s=round(self._late_s, 3))
            self._evaluate(from_tick=True)
            self._release_drainers()
            if now >= housekeeping_s:  # O(sessions) each: not on every tick at 1,000s of workers
                housekeeping_s = now + HOUSEKEEPING_S
                self.sessions.check_counts()
                q = self.quorum
                self.sessions.prune(now, self.cfg.session_keep_s,
                                    q.member_set if q is not None and not q.decided else frozenset())
            alarm.ring_by(max(min(self._next_due_s(now), housekeeping_s), now + fd.DUE_MARGIN_S))

    def _next_due_s(self, now: float) -> float:
        """When the next tick is needed, as far as the state now tells (messages that change it
        ring the alarm themselves: ``_tick_soon``, ``_on_progress``, a commit's shorter deadline)."""
        if self._form_blocked or self.completed_workers > 0 or self._late_s > self.cfg.tick_s:
            return now + self.cfg.tick_s  # a formation waits, the job drains, or this late tick judged no silence
        heard = [s.last_heartbeat_s for s in self.sessions.unordered() if s.healthy and s.connected]
        due = fd.heartbeat_due_s(min(heard), self.cfg.detector) if heard else math.inf
        q = self.quorum
        phases = self._live_phases(q) if q is not None and not q.decided else {}
        return min(due, fd.progress_due_s(now, phases, self.cfg.detector))

    def _live_phases(self, q: CurrentQuorum) -> dict[str, tuple[fd.Phase, float]]:
        return {w: self.sessions[w].phase for w in q.members if self.sessions[w].healthy}

    def _tick_soon(self) -> None:
        """A formation now waits on time (askers wait for others or for a timeout), or the job
        drains: tick again within ``tick_s``, and every ``tick_s`` while it lasts."""
        self._alarm.ring_by(self.host.now() + self.cfg.tick_s)

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
                self._tick_soon()

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
        if self._late_s > self.cfg.tick_s:
            return  # the coordinator was not running: what workers sent meanwhile may be unread (own_lateness_s)
        now -= self._late_s  # silence is judged as of when this tick was due
        # Only sessions that could be suspects go to the pure decision (cheap pre-filter at scale).
        stale_before = now - self.cfg.detector.heartbeat_timeout_s
        alive = {s.worker_id: fd.Liveness(s.connected, s.last_heartbeat_s) for s in self.sessions.unordered()
                 if (s.last_heartbeat_s < stale_before or not s.connected) and s.healthy}
        for sus in fd.heartbeat_suspects(now, alive, self.cfg.detector):
            cause = SuspicionCause.CONNECTION_LOST if not alive[sus.worker_id].connected else SuspicionCause.NO_HEARTBEAT
            self._suspect(self.sessions[sus.worker_id], cause, sus.reason)
        q = self.quorum
        # every member's phase began at or after the formation (_form sets them all), so nobody can
        # have fallen behind for progress_timeout_s before that long has passed since it
        if q is not None and not q.decided and now - q.formed_at_s > self.cfg.detector.progress_timeout_s:
            phases = self._live_phases(q)
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
        self.commits_total += 1
        if self._on_commit is not None:
            self._on_commit(rec)  # the full log (RUN/commits.jsonl) holds it before any worker hears of it
        self.cluster_step = q.step
        self._last_commit_s = now
        cfg = self._pace.on_commit(rec.step_s, self.cfg)
        if cfg is not self.cfg:  # available mode's timeouts follow the step: the watch may now be shorter
            self.cfg = cfg
            self._alarm.ring_by(fd.progress_deadline_s(now, cfg.detector))
        # recorded (the launcher's durable floor) before any decision leaves the process
        self.emit("step_committed", step=q.step, quorum_id=q.quorum_id, members=list(q.members), loss=loss,
                  step_s=rec.step_s)
        asked = False
        for w in sorted(q.reports):
            s = self.sessions[w]
            s.last_committed_step, s.has_state = q.step, True
            self._send(s, StepDecision(step=q.step, quorum_id=q.quorum_id, commit=True, reason=why, loss=loss))
            if s.asks_next == q.step + 1:
                self._asked_in_report(s, q.step + 1, now)
                asked = True
        if asked:
            # the grants follow the decisions in each outbox (same order on the wire): with the same
            # members still asking, the next step starts without another round trip
            self._form_blocked = False

    def _abort(self, q: CurrentQuorum, why: str) -> None:
        q.decided, q.intact = True, False
        self.steps_retried += 1
        for w in q.members:
            s = self.sessions[w]
            s.asks_next = -1  # the requests rode on reports of a step that did not commit: void
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
        qcfg = replace(self.cfg.quorum, merge_stale=False, defer_joiners_s=0.0) if finished else self.cfg.quorum
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
        spans = policy.shard_spans(weights)
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
        members = list(d.members)
        for rank, w in enumerate(d.members):
            s = self.sessions[w]
            self.sessions.set_waiting(s, False)
            s.phase = (fd.Phase.ASSIGNED, now)
            src = d.heal_from.get(w, "")
            # an epoch's member list goes to each worker once (its id names the same members for
            # good): at 1,024 workers, resending it with every grant was 1 M names a step
            full = s.members_sent_for != d.quorum_id
            s.members_sent_for = d.quorum_id
            self._send(s, QuorumAssigned(
                step=d.step, quorum_id=d.quorum_id, members=members if full else [], rank=rank, heal_from=src,
                heal_address=self.sessions[src].heal_address if src else "", heal_targets=heal_targets.get(w, []),
                restore_checkpoint=d.restore_checkpoint, write_checkpoint=(w == writer),
                shard_span=list(spans[rank]) if spans else [],
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


HOUSEKEEPING_S = 1.0  # how often the session-count self-check and the pruning of departed sessions run
