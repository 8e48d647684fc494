"""The worker's side of the step protocol: asyncio code behind the Host seam.

It joins the coordinator, heartbeats, waits for quorums, heals from peers, runs the gradient
all-reduce on the quorum's process group and waits for the commit decision. The synchronous user
API (:mod:`phalanx.train.api`) is a thin facade over it; the simulator drives it directly.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

from phalanx.collectives.process_group import ProcessGroupFactory
from phalanx.core.errors import (
    CollectiveError, CoordinatorLost, FrameRejected, JobOver, PeerTimeout, QuorumBroken, TransportError,
)
from phalanx.core.host import Connection, Host
from phalanx.core.messages import (
    AllreduceDone, Bundle, CheckpointUnusable, CheckpointWritten, Goodbye, Heartbeat, Hello, InjectFault, Progress, QuorumAssigned, QuorumBroken as QuorumBrokenMsg,
    QuorumCancel, QuorumRequest, Refused, Shutdown, StepDecision, Welcome,
)
from phalanx.train.assignment import Assignment, WorkerConfig
from phalanx.train.exchange import Exchange
from phalanx.train.healing import Healing, HealedState
from phalanx.train.quorum_groups import QuorumGroups

__all__ = ["Assignment", "HealedState", "StateProvider", "WorkerAgent", "WorkerConfig"]

# (state header, buffers, their SHA-256 hex or "" if the provider has none): the live training state for a heal
StateProvider = Callable[[], tuple[bytes, list[memoryview], str]]


class WorkerAgent(QuorumGroups, Healing):
    def __init__(self, host: Host, cfg: WorkerConfig, pg_factory: Callable[[str, str], ProcessGroupFactory],
                 state_provider: StateProvider | None = None,
                 on_fault: Callable[[InjectFault], None] | None = None) -> None:
        self.host, self.cfg = host, cfg
        QuorumGroups.__init__(self, pg_factory)
        self.state_provider, self._on_fault = state_provider, on_fault
        self.incarnation = f"{host.rng.getrandbits(48):012x}"
        self.welcome: Welcome | None = None
        self.max_quorum_id_seen = 0
        self.last_committed_step, self.has_state = -1, False
        self.shutdown_reason = ""
        self._conn: Connection | None = None
        self._assignment: asyncio.Future[Assignment] | None = None
        self._asked: tuple[int, Connection] | None = None  # fast path: the request rode on the report
        self._early: tuple[Assignment, Connection] | None = None  # ... its grant came before we waited
        self._decisions: dict[tuple[int, int], asyncio.Future[StepDecision]] = {}
        self._serving, self._heal_acks = None, {}  # Healing's: the quorum we heal others for, their acks
        self._snapshot: tuple[int, bytes, list[memoryview], str] | None = None  # one per quorum, ...
        self._capture_lock = asyncio.Lock()  # ... however many joiners ask
        self._lost = asyncio.Event()
        self._last_sent_s = float("-inf")  # any message is a sign of life: heartbeats fill the gaps
        self._phase_mark: tuple[int, int, str, float] | None = None  # (step, quorum id, phase, entered at)
        self._mark_sent: tuple[int, int, str, float] | None = None  # the last one a heartbeat carried
        self._decision_due_s: dict[tuple[int, int], float] = {}  # (step, quorum id) -> give up waiting then
        self._members: tuple[int, tuple[str, ...]] = (-1, ())  # the last member list received, with its quorum id
        self.heal_address = ""

    # ---- connection ----
    async def start(self) -> None:
        self._listener = listener = await self.host.transport.listen(self.cfg.heal_bind, self._serve_heal)
        self.heal_address = listener.address
        await self.reconnect()  # with backoff: the coordinator may be restarting as this worker starts
        self.host.spawn(self._heartbeats(), "heartbeat")

    async def _connect(self) -> None:
        conn = await self.host.transport.connect(self.cfg.coordinator_address, self.cfg.connect_timeout_s)
        await conn.send(Hello(worker_id=self.cfg.worker_id, incarnation=self.incarnation, pid=self.cfg.pid or os.getpid(),
                              heal_address=self.heal_address, last_committed_step=self.last_committed_step,
                              max_quorum_id_seen=self.max_quorum_id_seen, has_state=self.has_state))
        welcome, _ = await asyncio.wait_for(conn.recv(), self.cfg.connect_timeout_s)
        if isinstance(welcome, Refused):
            raise FrameRejected(f"coordinator refused this worker: {welcome.reason}")
        if not isinstance(welcome, Welcome):
            conn.close("protocol violation")
            raise FrameRejected(f"the coordinator answered Hello with {type(welcome).__name__}, not Welcome")
        self.welcome, self._conn = welcome, conn
        self._lost.clear()
        self.host.spawn(self._reader(conn), "reader")

    async def reconnect(self) -> None:
        """After losing the coordinator: retry with backoff until reconnect_timeout_s."""
        deadline = self.host.now() + self.cfg.reconnect_timeout_s
        delay_s = 0.05
        while True:
            try:
                await self._connect()
                return
            except FrameRejected:
                raise  # refused on purpose (wrong token, protocol version, policy): retrying cannot help
            except (TransportError, asyncio.TimeoutError, OSError) as e:
                if self.host.now() + delay_s > deadline:
                    raise CoordinatorLost(f"coordinator {self.cfg.coordinator_address} unreachable for "
                                          f"{self.cfg.reconnect_timeout_s:.0f} s: {e}") from e
                await self.host.sleep(delay_s)
                delay_s = min(delay_s * 2, 1.0)

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.is_closed and not self._lost.is_set()

    async def _send(self, message: Any) -> None:
        if not self.connected:
            raise CoordinatorLost("not connected to the coordinator")
        assert self._conn is not None
        self._last_sent_s = self.host.now()
        try:
            await self._conn.send(message)
        except TransportError as e:
            raise CoordinatorLost(f"lost the coordinator: {e}") from e

    async def _heartbeats(self) -> None:
        """Any message is a sign of life to the coordinator, so heartbeats only fill silences, and
        none lasts over 2 intervals (the timeout is 6): 2 intervals after the latest message this
        loop wakes and heartbeats if nothing else went out meanwhile, then every interval while
        idle. A worker whose reports go out at least every 2 intervals sends none."""
        seq = 0
        prev_wake_s = float("-inf")
        while not self.shutdown_reason or self._decision_due_s:  # a decision still awaited keeps its deadline
            interval_s = self.welcome.heartbeat_interval_s if self.welcome else 0.1
            now = self.host.now()
            self._expire_decisions(now)
            last_s = self._last_sent_s
            quiet = last_s <= prev_wake_s  # nothing went out since the previous wakeup
            prev_wake_s = now
            sleep_s = interval_s
            if not quiet:  # wake when that message is 2 intervals old (its wakeup sends if nothing followed)
                sleep_s = max(last_s + 2 * interval_s - now, 0.001)
            elif self.connected:
                seq += 1
                mark = self._phase_mark  # set on the loop, or by a body waiting on its own thread
                mark = None if mark is self._mark_sent else mark  # each mark goes out once
                self._mark_sent = mark or self._mark_sent
                # a phase still under way (a long all-reduce): its progress mark is the sign of life
                message = Heartbeat(seq=seq, step=self.last_committed_step) if mark is None else \
                    Progress(step=mark[0], quorum_id=mark[1], phase=mark[2], age_s=max(0.0, now - mark[3]))
                try:
                    await self._send(message)
                except CoordinatorLost:
                    pass
            await self.host.sleep(sleep_s)

    def _expire_decisions(self, now: float) -> None:
        for (step, quorum_id), due_s in list(self._decision_due_s.items()):
            fut = self._decisions.get((step, quorum_id))
            if now >= due_s and fut is not None and not fut.done():
                fut.set_exception(PeerTimeout(f"no commit decision for step {step} within "
                                              f"{self.cfg.decision_timeout_s:.0f} s"))

    async def _reader(self, conn: Connection) -> None:
        try:
            while True:
                message, _ = await conn.recv()
                if isinstance(message, Bundle):  # a decision and the next grant, say: in order
                    for m in message.items:
                        self._dispatch(m)
                else:
                    self._dispatch(message)
        except TransportError:
            pass
        finally:
            if conn is self._conn:
                self._lost.set()
                self._asked = self._early = None
                self._interrupt(None, CoordinatorLost("lost the coordinator during the step"))
                err = CoordinatorLost("connection to the coordinator was lost")
                for fut in [self._assignment, *self._decisions.values()]:
                    if fut is not None and not fut.done():
                        fut.set_exception(err)
                        fut.exception()  # mark retrieved; the waiter re-raises it

    def _dispatch(self, m: Any) -> None:
        if isinstance(m, QuorumAssigned):
            if m.quorum_id < self.max_quorum_id_seen:
                self.host.log("stale_assignment_ignored", quorum_id=m.quorum_id, seen=self.max_quorum_id_seen)
                return  # fencing: an older epoch's assignment is never acted on
            if m.members:
                self._members = (m.quorum_id, tuple(m.members))
            elif self._members[0] != m.quorum_id:  # a coordinator bug: start over on a new connection
                if self._conn is not None:
                    self._conn.close(f"a grant for quorum {m.quorum_id} named no members, and none are known for it")
                return
            a = Assignment(m.step, m.quorum_id, self._members[1], m.rank, m.heal_from, m.heal_address,
                           tuple(m.heal_targets), m.restore_checkpoint, m.write_checkpoint,
                           tuple(m.shard_span), m.local_step, m.catch_up)
            self.max_quorum_id_seen = a.quorum_id
            if self._assignment is not None and not self._assignment.done():
                self._assignment.set_result(a)
            elif self._conn is not None:
                self._early = (a, self._conn)  # granted on a piggybacked request: kept for its step
        elif isinstance(m, QuorumBrokenMsg):
            self._quorum_broken(m.quorum_id, m.reason)
        elif isinstance(m, StepDecision):
            fut = self._decisions.get((m.step, m.quorum_id))
            if fut is not None and not fut.done():
                fut.set_result(m)
        elif isinstance(m, InjectFault):
            if self._on_fault:
                self._on_fault(m)
        elif isinstance(m, Shutdown):
            self.shutdown_reason = m.reason
            if self._assignment is not None and not self._assignment.done():
                self._assignment.set_exception(JobOver(m.reason))
                self._assignment.exception()  # retrieved by the waiter

    # ---- the step protocol ----
    async def wait_for_quorum(self, step: int, total_steps: int = -1, timeout_s: float | None = None) -> Assignment:
        """Ask for a quorum for our next step; returns this member's assignment.

        When the request already rode on the last step's report (the fast path), nothing is sent:
        the grant may even be here already. With ``timeout_s`` (local-sgd's non-blocking sync)
        the request is withdrawn when it expires, so the coordinator does not put a worker that
        stopped waiting into a quorum.
        """
        asked, early = self._asked, self._early
        self._asked = self._early = None
        if early is not None and early[1] is self._conn and early[0].step == step and self.connected:
            return early[0]
        if not self.connected:
            await self.reconnect()
        self._assignment = asyncio.get_running_loop().create_future()
        if asked is None or asked != (step, self._conn):
            await self._send(QuorumRequest(step=step, last_committed_step=self.last_committed_step,
                                           has_state=self.has_state, total_steps=total_steps))
        limit_s = self.cfg.quorum_timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(limit_s):  # one timer; wait_for adds a future and a task per call
                return await self._assignment
        except asyncio.TimeoutError as e:
            if timeout_s is not None:
                try:
                    await self._send(QuorumCancel(step=step))
                except CoordinatorLost:
                    pass
            raise PeerTimeout(f"no quorum formed within {limit_s:.1f} s") from e

    def take_grant(self, step: int, ready: Callable[[Assignment], bool]) -> Assignment | None:
        """The fast path: the grant for ``step`` if it is already here, on this connection, and
        ``ready`` accepts it (consumed then, as ``wait_for_quorum`` would have); else None."""
        early = self._early
        if early is None or early[1] is not self._conn or early[0].step != step or not self.connected \
                or not ready(early[0]):
            return None
        self._asked = self._early = None
        return early[0]

    # ---- called from a body's own thread (real runs' bridge): one attribute read or store each ----
    def entering_allreduce(self, step: int, quorum_id: int, ex: Exchange) -> None:
        """The body waits for ``ex``'s collectives on its own thread before the vote: the progress
        watch's mark is set from there, as ``allreduce`` would set it (see _heartbeats), and a
        broken quorum or a lost coordinator wakes that wait (``_interrupt``)."""
        self._body_wait = (quorum_id, ex)
        self._phase_mark = (step, quorum_id, "allreduce", self.host.now())

    def quorum_gone(self, quorum_id: int) -> bool:
        """Whether the coordinator broke this quorum or is lost: a body waiting for the quorum's
        collectives on its own thread stops and lets the vote say so."""
        return quorum_id in self._broken or self._lost.is_set()

    async def allreduce(self, a: Assignment, ex: Exchange, tail: Any, verify: Callable[[], tuple[bool, float]],
                        compute_s: float, next_step: int = -1) -> StepDecision:
        """Start ``tail`` after the buckets the body launched, wait for them all, report the
        outcome (asking for ``next_step``'s quorum on the same message when >= 0), and wait for
        the verdict.

        ``verify`` inspects the reduced tail and returns (global batch covered exactly once,
        global loss); both ride in the data itself, so the accounting is what really moved.
        """
        key = (a.step, a.quorum_id)
        self._decisions[key] = asyncio.get_running_loop().create_future()
        t0 = self.host.now() - ex.waited_s  # the body may have waited for the collectives already
        self._body_wait = None  # ... and has stopped
        ok, error = True, ""
        # the progress watch's mark goes out only if this phase spans a silence of 2 heartbeat intervals
        # (in place of the heartbeat, see _heartbeats): a fault-free step sends none
        if self._phase_mark is None or self._phase_mark[:3] != (a.step, a.quorum_id, "allreduce"):
            self._phase_mark = (a.step, a.quorum_id, "allreduce", t0)
        try:
            if tail is not None:
                ex.launch(tail, 0.0)
            await self._race_broken(a, ex.complete(max(self.collective_timeout_s - ex.waited_s, 0.0), self.host.now))
        except CollectiveError as e:
            ok, error = False, str(e)
        except QuorumBroken as e:
            ok, error = False, str(e)
        finally:
            self._phase_mark = None  # the report below moves the phase on (or the step is gone)
        if a.quorum_id in self._broken:
            # The coordinator broke this quorum before our report left: it only does so when it
            # aborts the quorum's step (its abort came with the news), and a step needs every
            # member's report to commit. So the verdict is known here, without a round trip; a
            # report now would only be fenced.
            self._decisions.pop(key, None)
            return StepDecision(step=a.step, quorum_id=a.quorum_id, commit=False,
                                reason=self._broken[a.quorum_id] or error or "quorum broken")
        covered_once, loss = verify() if ok else (False, 0.0)
        conn = self._conn
        await self._send(AllreduceDone(step=a.step, quorum_id=a.quorum_id, ok=ok, error=error,
                                       loss=loss, samples_covered_once=covered_once,
                                       compute_s=compute_s, allreduce_s=self.host.now() - t0,
                                       next_step=next_step if ok else -1))
        # its deadline is watched by the heartbeat loop (no timer per step: the limit is a minute)
        self._decision_due_s[key] = self.host.now() + self.cfg.decision_timeout_s
        try:
            d = await self._decisions[key]
        finally:
            self._decisions.pop(key, None)
            self._decision_due_s.pop(key, None)
        if d.commit and ok and next_step >= 0 and conn is not None:
            self._asked = (next_step, conn)
        return d

    async def _send_quiet(self, message: Any) -> None:
        try:
            await self._send(message)
        except CoordinatorLost:
            pass

    def committed(self, step: int) -> None:
        assert step == self.last_committed_step + 1 or self.last_committed_step == -1 or step > self.last_committed_step
        self.last_committed_step, self.has_state = step, True

    async def checkpoint_written(self, step: int, path: str) -> None:
        try:
            await self._send(CheckpointWritten(step=step, path=path))
        except CoordinatorLost:
            pass

    async def checkpoint_unusable(self, path: str, reason: str) -> None:
        try:
            await self._send(CheckpointUnusable(path=path, reason=reason[:500]))
        except CoordinatorLost:
            pass

    async def goodbye(self, completed: bool, reason: str) -> None:
        try:
            await self._send(Goodbye(completed=completed, reason=reason, final_step=self.last_committed_step))
        except CoordinatorLost:
            pass

    async def drain(self) -> None:
        """After a completed Goodbye: stay reachable for ``drain_s`` so a late peer (a frozen worker
        that woke after the last step) can heal the final state from us. Ends early when the
        coordinator says no worker needs it any more, or when the coordinator is gone."""
        window_s = self.welcome.drain_s if self.welcome else 0.0
        deadline = self.host.now() + window_s
        try:
            while not self.shutdown_reason and self.connected:
                left_s = deadline - self.host.now()
                if left_s <= 0:
                    return
                self._assignment = asyncio.get_running_loop().create_future()
                try:
                    a = await asyncio.wait_for(self._assignment, left_s)
                except (asyncio.TimeoutError, JobOver, CoordinatorLost):
                    return
                if a.heal_targets:
                    await self.serve_heals(a)
        finally:
            self.leave("drained")

    def leave(self, reason: str) -> None:
        """This worker is done with the job: stop heartbeating, close the coordinator connection
        (the coordinator stops counting on it) and the heal listener."""
        self.shutdown_reason = self.shutdown_reason or reason
        if self._conn is not None:
            self._conn.close()
        listener = getattr(self, "_listener", None)
        if listener is not None:
            listener.close()
