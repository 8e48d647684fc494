"""The step body of real runs: the user's thread, fed tickets by the step engine (train/api.py's
``Job`` is the bridge; the simulator has a body of its own, on its loop)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from phalanx.train.step_engine import BodyResult, LoopExited, Ticket, Vote


@dataclass
class _VoteRequest:
    """A vote sent from the user's thread, run on the engine's own task (``ThreadBody.run``)."""

    voting: Coroutine[Any, Any, Vote]
    samples: int
    answer: concurrent.futures.Future[Vote]


ENGINE_ENDED = Vote(False, "the step engine has ended")


class ThreadBody:
    """The StepBody of real runs: hands each ticket to the user's thread (the body of their
    ``for step in job.steps(...)`` loop) and waits until that body has ended. A ticket the engine
    already handed over with the last vote (the fast path) is not queued again; results come back
    in order, so one that arrives before the engine waits for it is kept.

    The user's thread votes with ``send_vote``: the vote goes into the same queue and runs on the
    engine's task, which is waiting for this body anyway. No task is created per step, the user's
    thread hears the verdict before the engine does its bookkeeping, and a commit that hands the
    next ticket is the body's result at once, without another hop."""

    _END = object()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._tickets: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._results: asyncio.Queue[BodyResult | Exception | _VoteRequest] | None = None
        self._over = False  # the engine has ended: a vote sent now is answered at once

    async def run(self, ticket: Ticket) -> BodyResult:
        if self._results is None:
            self._results = asyncio.Queue()
        if not ticket.handed:
            self._tickets.put(ticket)
        while True:
            item = await self._results.get()
            if isinstance(item, _VoteRequest):
                done = await self._run_vote(item)
                if done is None:
                    continue  # the body goes on (an abort, or no ticket handed): its result follows
                return done
            if isinstance(item, Exception):
                raise item
            return item

    async def _run_vote(self, req: _VoteRequest) -> BodyResult | None:
        try:
            vote = await req.voting
        except asyncio.CancelledError:
            req.answer.cancel()  # the engine is being torn down: the user's thread sees a cancellation
            raise
        except Exception as e:  # a bug, not a fault (a vote never raises for those): the user's
            req.answer.set_exception(e)  # loop raises it, and its exit reaches the engine as LoopExited
            return None
        except BaseException as e:
            req.answer.set_exception(e)
            raise
        req.answer.set_result(vote)  # the user's thread goes on now; the engine's bookkeeping follows
        return BodyResult(True, req.samples, vote.loss, "") if vote.commit and vote.next is not None else None

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
        """The engine's task is done (on the loop): votes still queued, or sent from now on, get
        ENGINE_ENDED, and the user's loop its end."""
        self._over = True
        while self._results is not None and not self._results.empty():
            item = self._results.get_nowait()
            if isinstance(item, _VoteRequest):
                self._answer_ended(item)
        self._tickets.put(self._END)

    def send_vote(self, voting: Coroutine[Any, Any, Vote], samples: int) -> concurrent.futures.Future[Vote]:
        """On the user's thread: run the vote on the engine's task (see the class); its verdict
        comes in the returned future (waited for at once, or after a guess, train/speculation.py)."""
        answer: concurrent.futures.Future[Vote] = concurrent.futures.Future()
        self._loop.call_soon_threadsafe(self._put, _VoteRequest(voting, samples, answer))
        return answer

    @staticmethod
    def _answer_ended(req: _VoteRequest) -> None:
        req.voting.close()  # never started: nothing went on the wire for it
        req.answer.set_result(ENGINE_ENDED)

    def _put(self, item: BodyResult | Exception | _VoteRequest) -> None:
        if self._over and isinstance(item, _VoteRequest):
            self._answer_ended(item)
            return
        if self._results is None:
            self._results = asyncio.Queue()
        self._results.put_nowait(item)
