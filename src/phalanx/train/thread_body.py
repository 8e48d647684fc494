"""The step body of real runs: the user's thread, fed tickets by the step engine (train/api.py's
``Job`` is the bridge; the simulator has a body of its own, on its loop)."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Coroutine
from typing import Any

from phalanx.train.step_engine import BodyResult, LoopExited, Ticket, Vote


class ThreadBody:
    """The StepBody of real runs: hands each ticket to the user's thread (the body of their
    ``for step in job.steps(...)`` loop) and waits until that body has ended. A ticket the engine
    already handed over with the last vote (the fast path) is not queued again; results come back
    in order, so one that arrives before the engine waits for it is kept."""

    _END = object()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._tickets: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._results: asyncio.Queue[BodyResult | Exception] | None = None

    async def run(self, ticket: Ticket) -> BodyResult:
        if self._results is None:
            self._results = asyncio.Queue()
        if not ticket.handed:
            self._tickets.put(ticket)
        item = await self._results.get()
        if isinstance(item, Exception):
            raise item
        return item

    # ---- called on the user's thread ----
    def next_ticket(self) -> Ticket | None:
        """The next step to run, or None once the engine has ended (its result says how)."""
        item = self._tickets.get()
        return None if item is self._END else item

    def body_done(self, result: BodyResult) -> None:
        self._loop.call_soon_threadsafe(self._put, result)

    def body_exited(self, why: str) -> None:
        self._loop.call_soon_threadsafe(self._put, LoopExited(why))

    def ended(self, _fut: Any = None) -> None:
        self._tickets.put(self._END)

    async def vote(self, voting: Coroutine[Any, Any, Vote], samples: int) -> Vote:
        """The vote, on the loop. A commit that hands the next ticket is this body's result as well
        (nothing after it can un-commit the step: a failing user loop ends the job either way), so
        the engine gets it here, without another hop from the user's thread."""
        vote = await voting
        if vote.commit and vote.next is not None:
            self._put(BodyResult(True, samples, vote.loss, ""))
        return vote

    def _put(self, item: BodyResult | Exception) -> None:
        if self._results is None:
            self._results = asyncio.Queue()
        self._results.put_nowait(item)
