"""ThreadBody: the user's thread votes on the engine's own task (real runs' bridge).

A loop runs on a thread of its own, as the control thread does; the test's thread plays the user's
loop. The engine side is a task that awaits ``ThreadBody.run`` as the step engine does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Iterator

import pytest

from phalanx.train.assignment import Assignment
from phalanx.train.step_engine import BodyResult, Ticket, Vote
from phalanx.train.thread_body import ENGINE_ENDED, ThreadBody


def _ticket(step: int, handed: bool = False) -> Ticket:
    a = Assignment(step=step, quorum_id=1, members=("w0",), rank=0, heal_from="", heal_address="", heal_targets=(),
                   restore_checkpoint="", write_checkpoint=False)
    return Ticket(a, step, handed=handed)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, daemon=True)
    t.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    t.join(5)
    lp.close()


def _engine(loop: asyncio.AbstractEventLoop, body: ThreadBody, ticket: Ticket) -> concurrent.futures.Future:
    return asyncio.run_coroutine_threadsafe(body.run(ticket), loop)


def test_a_commit_that_hands_the_next_ticket_is_the_body_result_and_runs_on_the_engine_task(loop) -> None:
    body = ThreadBody(loop)
    engine = _engine(loop, body, _ticket(0))
    assert body.next_ticket().step == 0
    ran_on: list[asyncio.Task | None] = []

    async def voting() -> Vote:
        ran_on.append(asyncio.current_task())
        return Vote(True, loss=1.5, next=_ticket(1, handed=True))

    vote = body.send_vote(voting(), samples=8).result()
    assert vote.commit and vote.next is not None and vote.next.step == 1
    assert engine.result(5) == BodyResult(True, 8, 1.5, "")
    assert ran_on and ran_on[0] is not None and ran_on[0].get_coro().__qualname__ == "ThreadBody.run"


def test_an_abort_leaves_the_engine_waiting_for_the_body_result(loop) -> None:
    body = ThreadBody(loop)
    engine = _engine(loop, body, _ticket(0))
    body.next_ticket()

    async def voting() -> Vote:
        return Vote(False, "quorum broken")

    assert body.send_vote(voting(), samples=8).result() == Vote(False, "quorum broken")
    assert not engine.done()
    body.body_done(BodyResult(False, 0, None, "quorum broken"))
    assert engine.result(5) == BodyResult(False, 0, None, "quorum broken")


def test_a_vote_that_raises_reaches_the_user_and_the_engine_hears_the_loop_exit(loop) -> None:
    body = ThreadBody(loop)
    engine = _engine(loop, body, _ticket(0))
    body.next_ticket()

    async def voting() -> Vote:
        raise ValueError("a bug in the vote")

    with pytest.raises(ValueError, match="a bug in the vote"):
        body.send_vote(voting(), samples=8).result()
    assert not engine.done()  # the engine goes on waiting: the user's loop exits next
    body.body_exited("loop body raised")
    with pytest.raises(Exception, match="loop body raised"):
        engine.result(5)


def test_a_vote_after_the_engine_ended_is_answered_at_once_and_never_started(loop) -> None:
    body = ThreadBody(loop)
    started: list[bool] = []

    async def voting() -> Vote:
        started.append(True)
        return Vote(True)

    loop.call_soon_threadsafe(body.ended)
    assert body.next_ticket() is None
    assert body.send_vote(voting(), samples=8).result() is ENGINE_ENDED
    assert not started


def test_a_vote_queued_when_the_engine_ends_is_answered_too(loop) -> None:
    body = ThreadBody(loop)
    gate = threading.Event()
    loop.call_soon_threadsafe(gate.wait, 5)  # holds the loop while the vote is queued behind it
    answer: list[Vote] = []

    async def voting() -> Vote:
        return Vote(True)

    voter = threading.Thread(target=lambda: answer.append(body.send_vote(voting(), samples=1).result()))
    voter.start()
    time.sleep(0.2)  # the vote is sent (queued behind the gate) before the engine's end is
    loop.call_soon_threadsafe(body.ended)  # no engine ever waits for that vote
    gate.set()
    voter.join(5)
    assert answer == [ENGINE_ENDED]


def test_an_engine_cancelled_during_the_vote_cancels_the_user_wait(loop) -> None:
    body = ThreadBody(loop)
    engine = _engine(loop, body, _ticket(0))
    body.next_ticket()
    entered = threading.Event()

    async def voting() -> Vote:
        entered.set()
        await asyncio.sleep(30)
        return Vote(True)

    got: list[BaseException] = []

    def vote() -> None:
        try:
            body.send_vote(voting(), samples=1).result()
        except BaseException as e:  # noqa: BLE001 - the test records what the user's thread sees
            got.append(e)

    voter = threading.Thread(target=vote)
    voter.start()
    assert entered.wait(5)
    engine.cancel()
    voter.join(5)
    assert not voter.is_alive()
    assert got and isinstance(got[0], concurrent.futures.CancelledError)
