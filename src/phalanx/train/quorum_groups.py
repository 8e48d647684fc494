"""A worker's quorum groups: the process group of its current quorum, and the work a broken
quorum (or a lost coordinator) interrupts.

Mixed into :class:`phalanx.train.worker_agent.WorkerAgent`, whose host, welcome and connection
state it uses. The coordinator breaks a quorum only when it aborts the quorum's step; from then
on the quorum's group is never used again, and whatever waits on it (a collective, a heal, the
group's forming) raises :class:`QuorumBroken` at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from phalanx.collectives.process_group import ProcessGroup, ProcessGroupFactory
from phalanx.core.errors import CollectiveError, CoordinatorLost, QuorumBroken
from phalanx.train.exchange import Exchange

if TYPE_CHECKING:
    from phalanx.core.host import Host
    from phalanx.core.messages import Welcome
    from phalanx.train.assignment import Assignment


class QuorumGroups:
    # provided by WorkerAgent
    host: "Host"
    welcome: "Welcome | None"
    _lost: asyncio.Event

    def __init__(self, pg_factory: Callable[[str, str], ProcessGroupFactory]) -> None:
        self._make_pg_factory = pg_factory
        self._pg_factory: ProcessGroupFactory | None = None
        self._pg: ProcessGroup | None = None
        self._broken: dict[int, str] = {}  # the quorums the coordinator broke (the newest few) -> its reason
        self._racing: dict[asyncio.Task[Any], int] = {}  # tasks awaiting work a broken quorum interrupts -> its id
        self._interrupted: dict[asyncio.Task[Any], Exception] = {}
        self._body_wait: tuple[int, Exchange] | None = None  # a body waiting on its own thread: (quorum id, its exchange)
        self._forming: Any = None  # the task forming a group for open_exchange, if any

    @property
    def collective_timeout_s(self) -> float:
        """A collective's deadline (group builds too): the coordinator's word, 5 s before its Welcome."""
        return self.welcome.collective_timeout_s if self.welcome else 5.0

    def _quorum_broken(self, quorum_id: int, reason: str) -> None:
        floor = max([quorum_id, *self._broken]) - 8  # bounded: the newest few
        self._broken = {q: w for q, w in self._broken.items() if q >= floor}
        self._broken[quorum_id] = reason
        if self._pg is not None and self._pg.quorum_id == quorum_id:
            self._pg.abandon()  # never used again: let go now (a dead peer's group stops taking cores)
            self._pg = None
        self._interrupt(quorum_id, QuorumBroken(f"quorum {quorum_id} was broken by the coordinator"))

    async def process_group(self, a: Assignment) -> ProcessGroup:
        if self._pg is not None and self._pg.quorum_id == a.quorum_id:
            return self._pg
        if self._pg is not None:
            self._pg.abandon()  # a new epoch: the old group is never used again
            self._pg = None
        if self._pg_factory is None:
            assert self.welcome is not None
            self._pg_factory = self._make_pg_factory(self.welcome.store_address, self.welcome.run_id)
        timeout_s = self.collective_timeout_s
        self._pg = await self._race_broken(a, self._pg_factory.create(a.quorum_id, a.rank, a.world_size, timeout_s))
        return self._pg

    def open_exchange(self, a: Assignment, formed: Callable[[], None] | None = None) -> Exchange:
        """This attempt's collectives, returned at once: on the quorum's group if it is open, else
        on one that forms meanwhile, on a task of its own, while the body computes (a new quorum's
        group took 23-35 ms to form in a kill's recovery on 2 cores, and the body waited for it).
        What the body launches before the group is there waits in the exchange, in order; the vote
        waits for the forming. A group that cannot form fails the exchange: the vote reports it.
        ``formed`` is called once a group formed for it (the engine's span)."""
        pg = self._pg
        if pg is not None and pg.quorum_id == a.quorum_id:
            return Exchange(pg)
        forming = self._forming
        if forming is not None and not forming.done():
            forming.cancel()  # an older quorum's, nobody waits for it: never two builds at once
        ex = Exchange(None)
        ex.opening = self._forming = self.host.spawn(self._open(a, ex, formed), f"group-q{a.quorum_id}")
        return ex

    async def _open(self, a: Assignment, ex: Exchange, formed: Callable[[], None] | None) -> None:
        try:
            pg = await self.process_group(a)
        except (CollectiveError, QuorumBroken, CoordinatorLost) as e:
            ex.open_failed(str(e))
            return
        except asyncio.CancelledError:
            ex.open_failed(f"the forming of quorum {a.quorum_id}'s group was cancelled")
            raise
        ex.opened(pg)
        if formed is not None:
            formed()

    async def _race_broken(self, a: Assignment, coro: Any) -> Any:
        """Run ``coro`` unless the coordinator declares this quorum broken (or is lost) first.

        ``coro`` runs in the calling task, which ``_interrupt`` cancels, as ``asyncio.timeout``
        does: no task per call (this runs for every member on every step). The loop is single
        threaded, so an interrupt can only land while the task is suspended inside ``coro``; its
        CancelledError surfaces there and becomes ``why``. A cancellation from outside too (a
        simulated crash) propagates as a cancellation.
        """
        if self._lost.is_set() or a.quorum_id in self._broken:
            coro.close()
            if self._lost.is_set():
                raise CoordinatorLost("lost the coordinator during the step")
            raise QuorumBroken(f"quorum {a.quorum_id} was broken by the coordinator")
        me = asyncio.current_task()
        assert me is not None and me not in self._racing, "one race at a time per task"
        self._racing[me] = a.quorum_id
        try:
            return await coro
        except asyncio.CancelledError:
            why = self._interrupted.pop(me, None)
            if why is None or me.uncancel() > 0:  # not ours, or cancelled from outside as well
                raise
            raise why from None
        finally:
            self._racing.pop(me, None)
            self._interrupted.pop(me, None)

    def _interrupt(self, quorum_id: int | None, why: Exception) -> None:
        """Cancel the racing work of ``quorum_id`` (None: all of it), which then raises ``why``,
        and wake a body waiting for that quorum's collectives on its own thread."""
        wait = self._body_wait
        if wait is not None and (quorum_id is None or wait[0] == quorum_id):
            wait[1].wake()
        for task, qid in list(self._racing.items()):
            if (quorum_id is None or qid == quorum_id) and not task.done() and task not in self._interrupted:
                self._interrupted[task] = why
                task.cancel()
