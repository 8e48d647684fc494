"""One step attempt's collectives: gradient buckets started as they become ready, then the tail.

The engine opens an ``Exchange`` on the quorum's process group before the body runs, so a body
can start each gradient bucket's all-reduce the moment its gradients are ready: real runs from
the autograd hooks of the backward pass, on the user's thread (what DDP's reducer does), the
simulator from its loop. The vote then starts the small tail (coverage and loss), waits for
everything with one deadline, and only then reports. Order is the contract: every rank starts the
same collectives in the same order (buckets by index, then the tail), whoever starts them.

A new quorum's group forms while the body computes (``opening``): what the body launches before
it has formed waits, in order, and ``opened`` starts it all at once; the vote waits for the
forming (``opening``), then for the collectives.

No torch or clock here (asyncio only to wait for a forming group): tensors are opaque and the
process group is the seam.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from phalanx.collectives.process_group import Pending, ProcessGroup
from phalanx.core.errors import CollectiveError

# How often a body waiting for its collectives looks whether the step is lost, should nothing wake
# it: the control loop wakes it (``wake``) when the coordinator breaks the quorum or is lost, and
# the collective's own completion does; this is the safety net, and the deadline's granularity.
WAIT_HERE_SLICE_S = 0.05


class Exchange:
    """The collectives of one attempt at one step on one quorum's process group.

    ``launch`` may be called from the body's thread; ``complete`` runs on the control loop after
    the body has launched everything it will (it is blocked in the vote meanwhile).
    """

    def __init__(self, pg: ProcessGroup | None, failed: str = "") -> None:
        self.pg = pg
        self.failed = failed  # why this attempt cannot all-reduce ("" = it can)
        # the group's forming, when ``pg`` is not there yet: done once ``opened`` or ``open_failed``
        # has been called (a task of the worker's agent: QuorumGroups.open_exchange)
        self.opening: Awaitable[Any] | None = None
        self._pending: list[Pending] = []
        self._queued: list[tuple[Any, float]] = []  # to issue from the loop, in order
        self._lock = threading.Lock()
        self.waited_s = 0.0  # spent in wait_here, on the body's thread, before the vote reached the loop

    def opened(self, pg: ProcessGroup) -> None:
        """The group has formed (on the loop): start what the body queued meanwhile, in order."""
        with self._lock:
            self.pg, queued, self._queued = pg, self._queued, []
            for i, (tensor, share) in enumerate(queued):
                if self.failed:
                    return
                try:
                    pending = pg.start_allreduce_sum(tensor, share)
                except CollectiveError as e:
                    self.failed = str(e)
                    return
                if pending is None:  # not now: the rest goes out from the loop, in order
                    self._queued = queued[i:]
                    return
                self._pending.append(pending)

    def open_failed(self, why: str) -> None:
        with self._lock:
            self.failed = self.failed or why

    def launch(self, tensor: Any, share: float = 1.0) -> None:
        """Start summing ``tensor`` in place across the quorum (or queue it, keeping the order)."""
        with self._lock:
            if self.failed:
                return
            if self.pg is None:
                if self.opening is not None:  # forming: ``opened`` starts it
                    self._queued.append((tensor, share))
                return
            if not self._queued:
                try:
                    pending = self.pg.start_allreduce_sum(tensor, share)
                except CollectiveError as e:
                    self.failed = str(e)
                    return
                if pending is not None:
                    self._pending.append(pending)
                    return
            self._queued.append((tensor, share))  # after the first deferral, everything follows in order

    def wait_here(self, stop: Callable[[], bool], timeout_s: float, now: Callable[[], float],
                  slice_s: float = WAIT_HERE_SLICE_S) -> None:
        """On the body's thread, after it has launched everything and before the vote goes to the
        loop: block until every started collective has finished, ``stop()`` says the step is lost
        (its quorum broken, the coordinator gone: checked when ``wake`` ends a slice, and between
        slices of ``slice_s``) or ``timeout_s`` passes. ``complete`` then finds them finished: the
        loop is woken once, with something to report. What is queued, or finishes only on the
        loop, is left to ``complete``; the time spent here counts against its deadline
        (``waited_s``)."""
        with self._lock:
            pending = [] if self.failed or self._queued else list(self._pending)
        t0 = now()
        try:
            if pending and stop():  # lost before the waker was known: nothing will wake this wait
                return
            for p in pending:
                while not p.wait_here(slice_s):
                    if stop() or now() - t0 >= timeout_s:
                        return
        finally:
            self.waited_s = now() - t0

    def wake(self) -> None:
        """From any thread (the control loop, when the step is lost): a ``wait_here`` under way
        looks at ``stop()`` now, and one about to start does so before it blocks."""
        with self._lock:
            pending = list(self._pending)
        for p in pending:
            p.wake()

    async def complete(self, timeout_s: float, now: Callable[[], float]) -> None:
        """Issue what was queued, then wait for every collective (one deadline for all).
        Raises CollectiveError; a cancelled wait abandons the group (the step was aborted)."""
        if self.opening is not None and not self.failed and self.pg is None:
            try:
                await self.opening  # the group's forming (its own deadline): opened or open_failed
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if me is None or me.cancelling():
                    raise  # this wait itself was cancelled (the step aborted, the worker ends)
                self.failed = self.failed or "the group's forming was cancelled"
        if self.failed or self.pg is None:
            raise CollectiveError(self.failed or "no process group")
        deadline_s = now() + timeout_s
        try:
            for pending in self._pending:
                await pending.wait(max(deadline_s - now(), 0.001))
            for tensor, _share in self._queued:
                await self.pg.allreduce_sum(tensor, max(deadline_s - now(), 0.001))
        except CollectiveError as e:
            self.failed = str(e)
            raise
