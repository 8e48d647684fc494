"""The life of a step, written once: real runs and the simulator both run this engine.

    acquire (quorum; restore, heal or serve heals) -> body (compute, then a vote) -> commit or
    roll back -> checkpoint -> next step;   at the end: goodbye, drain, or a typed error

The engine is asyncio code behind seams and touches no torch, clock, thread or socket itself:

- ``WorkerAgent`` (the Host and process-group seams): quorum requests, heals, the all-reduce vote;
- ``StepBody``: what runs between acquire and commit. Real runs hand each ticket to the user's
  thread (``Job.steps()`` in :mod:`phalanx.train.api`); the simulator sleeps the compute time in
  virtual time and computes a numpy gradient (:mod:`phalanx.sim.worker`). Each ticket carries the
  step's :class:`~phalanx.train.exchange.Exchange` on the quorum's process group (a new quorum's
  forms while the body computes), so the body
  starts its gradient buckets' all-reduces as they become ready; it then calls
  :meth:`StepEngine.vote` once with the small tail (coverage and loss, :mod:`phalanx.train.step_buffer`);
- ``TrainingState``: restore a checkpoint, load a heal, write a checkpoint, build and apply a
  local-sgd merge;
- ``StepObserver``: spans and events (a worker's JSONL log, or the simulator's trace and checks).

Which errors retry and which end the job is one table (``RETRY_ACQUIRE``, ``VOTE_LOST``), with one
bound (``MAX_ATTEMPTS_PER_STEP``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from phalanx.core.errors import (
    CheckpointError, CollectiveError, CoordinatorLost, FinalStateUnavailable, HealError, JobFailed, JobOver,
    PeerTimeout, QuorumBroken, StaleEpoch, StateCorrupt, TransportError,
)
from phalanx.train.exchange import Exchange
from phalanx.train.step_buffer import MergeLayout
from phalanx.train.worker_agent import Assignment, HealedState, WorkerAgent

MAX_ATTEMPTS_PER_STEP = 100  # quorum attempts for one step (or one merge) before the job fails
# acquiring a quorum failed in a way a new attempt can fix (the coordinator re-forms)
RETRY_ACQUIRE: tuple[type[Exception], ...] = (
    CoordinatorLost, QuorumBroken, HealError, StaleEpoch, StateCorrupt, TransportError)
# the vote got no decision: the step is not committed here and is rolled back
VOTE_LOST: tuple[type[Exception], ...] = (CoordinatorLost, PeerTimeout, CollectiveError)
# PeerTimeout while acquiring (no quorum within quorum_timeout_s) ends the job: JobFailed.
# JobOver (the coordinator ended this worker's part while it was behind) ends it: FinalStateUnavailable.


@dataclass(frozen=True)
class Ticket:
    """One attempt at one step (or one local-sgd local step) handed to the body."""

    assignment: Assignment
    step: int
    local: bool = False  # local-sgd: a local step, no vote
    exchange: Exchange | None = None  # the step's collectives (None for a local step)
    handed: bool = False  # already given to the body with the last vote (the fast path)


@dataclass(frozen=True)
class BodyResult:
    committed: bool
    samples: int = 0  # samples this worker trained in the step
    loss: float | None = None
    reason: str = ""  # why it did not commit


@dataclass(frozen=True)
class Vote:
    commit: bool
    reason: str = ""
    loss: float = 0.0
    # the fast path: the next step's ticket, granted and ready, handed to the body with this verdict
    # so it can go on without waiting for the engine (None: it waits for its next ticket)
    next: Ticket | None = None


class LoopExited(Exception):
    """The user's loop left ``job.steps()`` early (an exception or a break)."""


class StepBody(Protocol):
    async def run(self, ticket: Ticket) -> BodyResult: ...


class TrainingState(Protocol):
    async def restore_checkpoint(self, path: str) -> int:
        """Load a durable checkpoint; returns its step."""

    async def load_healed(self, healed: HealedState) -> None: ...

    async def write_checkpoint(self, step: int, a: Assignment) -> str:
        """Write a durable checkpoint of the committed state; returns its path."""

    async def merge_buffer(self, weight: float, loss: float) -> tuple[Any, np.ndarray]:
        """local-sgd: ``[params * weight | weight | loss * weight]`` as (buffer, numpy view)."""

    async def apply_merge(self, buffer: Any) -> None: ...


class StepObserver(Protocol):
    def span(self, name: str, start_s: float, **fields: Any) -> None: ...

    def event(self, name: str, **fields: Any) -> None: ...


@dataclass
class Counters:
    steps_committed: int = 0
    steps_retried: int = 0
    heals: int = 0


class StepEngine:
    def __init__(self, agent: WorkerAgent, body: StepBody, state: TrainingState, observer: StepObserver) -> None:
        self.agent, self.body, self.state, self.obs = agent, body, state, observer
        self.counters = Counters()
        self.completed = False  # True once the loop ran to its end holding the final state
        self.ended_reason = ""
        self.last: Assignment | None = None
        self.max_world_size = 1  # the largest quorum this worker has been in
        self._total = -1
        self._handed: Ticket | None = None  # the ticket the last vote handed to the body

    @property
    def now(self) -> float:
        return self.agent.host.now()

    @property
    def mode(self) -> str:
        return self.agent.welcome.mode if self.agent.welcome else "strict"

    async def run(self, total: int) -> None:
        """Train steps ``last committed + 1 .. total - 1``; returns holding the final state or raises."""
        self._total = total
        try:
            if self.mode == "local-sgd":
                await self._run_local_sgd(total)
            else:
                await self._run_steps(total)
        except LoopExited as e:
            await self.finish(False, str(e) or "loop body raised or exited early")
            return
        await self.finish(True, "finished")

    # ---- strict and available: one global step at a time ----
    async def _run_steps(self, total: int) -> None:
        step = self.agent.last_committed_step + 1
        while step < total:
            handed, self._handed = self._handed, None
            if handed is not None and handed.step == step:
                a, ticket = handed.assignment, handed  # the body already has it (the fast path)
                self._note(a, self.now, step)
            else:
                a = await self._acquire(step, total)
                if a.step >= total or a.catch_up:
                    return  # a catch-up restored or healed the final state
                # open before the body computes, so buckets start early; a new quorum's group
                # forms meanwhile (the vote waits for it if it must)
                t0 = self.now
                ex = self.agent.open_exchange(a, lambda a=a, t0=t0: self.obs.span(  # type: ignore[misc]
                    "exchange_open", t0, step=a.step, quorum_id=a.quorum_id))
                ticket = Ticket(a, a.step, exchange=ex)
            result = await self.body.run(ticket)  # a group that cannot form fails its vote
            if result.committed:
                await self._after_commit(a, a.step, result.loss)
                step = a.step + 1
            else:
                self._handed = None
                step = a.step
                self.counters.steps_retried += 1
                self.obs.event("rolled_back", step=a.step, quorum_id=a.quorum_id, reason=result.reason)

    async def vote(self, a: Assignment, ex: Exchange, tail: Any, verify: Callable[[], tuple[bool, float]],
                   compute_s: float) -> Vote:
        """Finish the step's all-reduce (the buckets ``ex`` started, then ``tail``, in place) and
        wait for the coordinator's verdict. Never raises for faults: a lost vote is a rollback.

        The fast path: the report also asks for the next step's quorum, unless this is the last
        step or this worker writes a checkpoint after it (it would start late, and a peer already
        computing would wait for it): then it asks the normal way once it is ready.
        """
        ask_next = self.asks_next(a)
        try:
            d = await self.agent.allreduce(a, ex, tail, verify, compute_s, ask_next)
        except VOTE_LOST as e:
            return Vote(False, f"no commit decision: {e}")
        nxt = await self._ready_next(a, ask_next) if d.commit and ask_next >= 0 else None
        return Vote(d.commit, d.reason or ("" if d.commit else "step aborted"), d.loss, nxt)

    def asks_next(self, a: Assignment) -> int:
        """The step whose quorum ``a``'s report asks for (the fast path), or -1: none after the
        last step, none before a checkpoint this worker writes, none in local-sgd."""
        nxt = a.step + 1
        return nxt if 0 <= nxt < self._total and not a.write_checkpoint and self.mode != "local-sgd" else -1

    async def _ready_next(self, a: Assignment, step: int) -> Ticket | None:
        """The fast path's last hop: when the grant for ``step`` came right behind the commit and
        needs nothing before the body runs (same quorum id, so the group is open; no heal, no
        restore, not a catch-up), the body gets its next ticket with this verdict, and the engine
        takes the committed step's bookkeeping while the body already computes. Anything else
        goes through acquire as usual."""
        def plain(g: Assignment) -> bool:
            return (g.quorum_id == a.quorum_id and not g.heal_from and not g.heal_targets
                    and not g.restore_checkpoint and not g.catch_up)

        g = self.agent.take_grant(step, plain)
        if g is None:
            return None
        ticket = Ticket(g, g.step, exchange=self.agent.open_exchange(g), handed=True)  # open: same quorum
        self._handed = ticket
        return ticket

    async def _after_commit(self, a: Assignment, step: int, loss: float | None) -> None:
        self.agent.committed(step)
        self.counters.steps_committed += 1
        self.obs.event("committed", step=step, quorum_id=a.quorum_id, loss=loss)
        if a.write_checkpoint:
            await self._write_checkpoint(a, step)

    async def _write_checkpoint(self, a: Assignment, step: int) -> None:
        t0 = self.now
        path = await self.state.write_checkpoint(step, a)
        await self.agent.checkpoint_written(step, path)
        self.obs.span("checkpoint", t0, step=step)

    # ---- acquire: a quorum, then restore / heal / serve ----
    async def _acquire(self, step: int, total: int) -> Assignment:
        t0 = self.now
        for _ in range(MAX_ATTEMPTS_PER_STEP):
            try:
                a = await self._request(step, total, None)
            except RETRY_ACQUIRE as e:
                await self._before_retry(step, e)
                continue
            except PeerTimeout as e:
                raise JobFailed(f"{self.agent.cfg.worker_id}: {e}") from e
            self._note(a, t0, step)
            return a
        raise JobFailed(f"{self.agent.cfg.worker_id}: no usable quorum for step {step} after "
                        f"{MAX_ATTEMPTS_PER_STEP} attempts")

    async def _request(self, step: int, total: int, timeout_s: float | None) -> Assignment:
        try:
            a = await self.agent.wait_for_quorum(step, total, timeout_s)
            await self._prepare(a)
        except JobOver as e:
            await self._end_without_final(total, str(e))
        return a

    async def _before_retry(self, step: int, e: Exception) -> None:
        self.obs.event("acquire_retry", step=step, reason=str(e))
        if isinstance(e, CoordinatorLost):
            try:
                await self.agent.reconnect()
            except CoordinatorLost as lost:
                raise JobFailed(f"{self.agent.cfg.worker_id}: {lost}") from lost

    def _note(self, a: Assignment, t0: float, step: int) -> None:
        self.last = a
        self.max_world_size = max(self.max_world_size, a.world_size)
        self.obs.span("quorum_wait", t0, step=step, quorum_id=a.quorum_id)

    async def _prepare(self, a: Assignment) -> None:
        """Restore, heal or serve before the body runs (the body is idle, so state is stable)."""
        if a.restore_checkpoint:
            t0 = self.now
            try:
                ck_step = await self.state.restore_checkpoint(a.restore_checkpoint)
            except (CheckpointError, OSError) as e:
                if a.catch_up:  # the finished job's final checkpoint was all there was
                    raise JobOver(f"restoring the final checkpoint {a.restore_checkpoint} failed: {e}") from e
                # the coordinator stops offering it (it stalls with a clear reason), and we ask
                # again: a bad checkpoint must not crash-loop every restarted worker
                await self.agent.checkpoint_unusable(a.restore_checkpoint, str(e))
                raise StateCorrupt(f"checkpoint {a.restore_checkpoint} is unusable: {e}") from e
            self.agent.last_committed_step, self.agent.has_state = ck_step, True
            self.obs.span("restore", t0, step=ck_step, path=a.restore_checkpoint)
        elif a.heal_from:
            t0 = self.now
            healed = await self.agent.heal(a, self.state.load_healed)  # loaded before the source is told
            await self.agent.heal_done(a, healed.checksum)
            self.counters.heals += 1
            self.obs.span("heal", t0, step=a.step, source=a.heal_from, quorum_id=a.quorum_id)
        if a.heal_targets:
            t0 = self.now
            await self.agent.serve_heals(a)
            self.obs.span("heal_serve", t0, step=a.step, targets=list(a.heal_targets))

    # ---- the end ----
    async def finish(self, completed: bool, reason: str) -> None:
        """Say goodbye, holding the final state or not. A worker that holds it stays reachable for
        a bounded drain window, so a late peer can heal from it (the body is idle meanwhile)."""
        self.completed, self.ended_reason = completed, reason
        await self.agent.goodbye(completed, reason)
        if completed:
            await self.agent.drain()
        else:
            self.agent.leave(reason)

    async def _end_without_final(self, total: int, why: str) -> None:
        """The job ended while this worker was behind and nothing could catch it up: never a normal
        end (a loop that saves the model afterwards would save a stale one)."""
        held = self.agent.last_committed_step
        self.obs.event("final_state_unavailable", held_step=held, reason=why)
        await self.finish(False, why)
        final = total if self.mode == "local-sgd" else total - 1
        raise FinalStateUnavailable(self.agent.cfg.worker_id, held, final, why)

    # ---- local-sgd: local steps, a merge every H steps, bounded staleness ----
    async def _run_local_sgd(self, total: int) -> None:
        """Local steps need no coordinator; a merge (the coordinator's "step") every
        ``sync_every_steps``. A failed non-blocking merge is skipped; at ``max_staleness_steps``
        local steps past the last merge the worker blocks until it merges."""
        assert self.agent.welcome is not None
        every, bound = self.agent.welcome.sync_every_steps, self.agent.welcome.max_staleness_steps
        samples, loss = 0, 0.0
        a = await self._sync(0, True, total, 0, loss)  # round 0: everyone starts from one state
        assert a is not None, "a blocking merge returns an assignment or raises"
        k = total if a.catch_up else max(0, a.local_step)
        merged_at = k
        while k < total:
            local = a._replace(step=k, heal_from="", heal_targets=(), restore_checkpoint="", write_checkpoint=False)
            result = await self.body.run(Ticket(local, k, local=True))
            samples += result.samples
            loss = result.loss if result.loss is not None else loss
            k += 1
            self.counters.steps_committed += 1
            self.obs.event("local_step", step=k - 1, loss=result.loss, staleness=k - merged_at, samples=result.samples)
            if k % every == 0 or k == total or k - merged_at >= bound:
                got = await self._sync(k, k - merged_at >= bound or k == total, total, samples, loss)
                if got is not None:
                    a, samples = got, 0
                    k = total if a.catch_up else max(k, a.local_step)
                    merged_at = k

    async def _sync(self, k: int, must: bool, total: int, samples: int, loss: float) -> Assignment | None:
        """One merge at local step ``k``: the assignment on commit (or on a catch-up to the finished
        job's final state), None if this non-blocking merge was skipped."""
        assert self.agent.welcome is not None
        timeout_s = None if must else self.agent.welcome.sync_timeout_s
        t0 = self.now
        for _ in range(MAX_ATTEMPTS_PER_STEP):
            if not must and not self.agent.connected:
                self.obs.event("merge_skipped", step=k, reason="not connected to the coordinator")
                return None
            try:
                a = await self._request(k, total, timeout_s)
            except PeerTimeout as e:
                if must:
                    raise JobFailed(f"{self.agent.cfg.worker_id}: {e}") from e
                self.obs.event("merge_skipped", step=k, reason=str(e))
                return None
            except RETRY_ACQUIRE as e:
                if isinstance(e, CoordinatorLost) and not must:
                    return None
                await self._before_retry(k, e)
                continue
            self._note(a, t0, k)
            if a.catch_up or await self._merge(a, k, samples, loss):
                return a
            if not must:
                return None
        raise JobFailed(f"{self.agent.cfg.worker_id}: no merge at local step {k} after {MAX_ATTEMPTS_PER_STEP} attempts")

    async def _merge(self, a: Assignment, k: int, samples: int, loss: float) -> bool:
        """The merge rule: parameters averaged with weights = samples trained since the member's
        last merge, plus one (a member that trained nothing, e.g. just healed, counts a little,
        and the first merge is a plain average of identical states). Optimizer state stays local."""
        buffer, view = await self.state.merge_buffer(float(samples + 1), loss)
        t0 = self.now
        ex = self.agent.open_exchange(a)
        ex.launch(buffer, 1.0)
        v = await self.vote(a, ex, None, lambda: MergeLayout.verify(view), 0.0)
        self.obs.span("allreduce", t0, step=k, quorum_id=a.quorum_id, commit=v.commit, reason=v.reason)
        if not v.commit:
            return False
        await self.state.apply_merge(buffer)
        self.agent.committed(a.step)
        self.obs.event("merged", round=a.step, step=k, quorum_id=a.quorum_id, members=list(a.members),
                       continue_at=max(k, a.local_step), loss=v.loss)
        if a.write_checkpoint:
            await self._write_checkpoint(a, a.step)
        return True
