"""A new quorum's group forms while the body computes (``QuorumGroups.open_exchange``): what the
body launches before it has formed waits in the exchange, in order, and goes out when it forms;
the vote waits for the forming; a group that cannot form fails the vote, never the body."""

import asyncio
import threading
from typing import Any

import pytest

from phalanx.collectives.process_group import LocalProcessGroup
from phalanx.core.errors import CollectiveError
from phalanx.train.assignment import Assignment
from phalanx.train.exchange import Exchange
from phalanx.train.quorum_groups import QuorumGroups


def _done() -> Any:
    return LocalProcessGroup(0).start_allreduce_sum(None)  # a collective already finished


class _Group:
    """Records what was started, in order, and from which thread."""

    world_size, rank = 2, 0

    def __init__(self, quorum_id: int = 1, defer_after: int | None = None) -> None:
        self.quorum_id = quorum_id
        self.started: list[tuple[Any, float, str]] = []
        self.issued: list[Any] = []  # from the loop, with allreduce_sum
        self.defer_after = defer_after  # start_allreduce_sum answers None from this many on

    def start_allreduce_sum(self, tensor: Any, share: float = 1.0) -> Any:
        if self.defer_after is not None and len(self.started) >= self.defer_after:
            return None
        self.started.append((tensor, share, threading.current_thread().name))
        return _done()

    async def allreduce_sum(self, tensor: Any, timeout_s: float) -> None:
        self.issued.append(tensor)

    def abandon(self) -> None:
        pass


def _forming() -> tuple[Exchange, asyncio.Event]:
    formed = asyncio.Event()
    ex = Exchange(None)
    ex.opening = asyncio.ensure_future(formed.wait())
    return ex, formed


def test_launches_before_the_group_formed_go_out_in_order_when_it_does() -> None:
    async def main() -> None:
        ex, formed = _forming()
        ex.launch("b0", 0.5)
        t = threading.Thread(target=ex.launch, args=("b1", 0.4), name="body")  # the user's thread
        t.start()
        t.join()
        g = _Group()
        assert g.started == [] and ex.pg is None
        ex.opened(g)
        formed.set()
        assert [s[:2] for s in g.started] == [("b0", 0.5), ("b1", 0.4)]
        ex.launch("tail", 0.0)  # after: straight to the group
        await ex.complete(1.0, lambda: 0.0)
        assert [s[0] for s in g.started] == ["b0", "b1", "tail"] and ex.failed == ""

    asyncio.run(main())


def test_the_vote_waits_for_the_forming_then_for_the_collectives() -> None:
    async def main() -> None:
        ex, formed = _forming()
        ex.launch("b0")
        done = asyncio.ensure_future(ex.complete(1.0, lambda: 0.0))
        await asyncio.sleep(0.01)
        assert not done.done(), "nothing to wait for until the group has formed"
        g = _Group()
        ex.opened(g)
        formed.set()
        await asyncio.wait_for(done, 1.0)
        assert [s[0] for s in g.started] == ["b0"]

    asyncio.run(main())


def test_what_the_group_defers_when_it_forms_is_issued_from_the_loop_in_order() -> None:
    async def main() -> None:
        ex, formed = _forming()
        for name in ("b0", "b1", "b2"):
            ex.launch(name)
        g = _Group(defer_after=1)
        ex.opened(g)
        formed.set()
        ex.launch("tail")  # behind the deferred ones, never ahead of them
        await ex.complete(1.0, lambda: 0.0)
        assert [s[0] for s in g.started] == ["b0"] and g.issued == ["b1", "b2", "tail"]

    asyncio.run(main())


def test_a_group_that_could_not_form_fails_the_vote_and_starts_nothing() -> None:
    async def main() -> None:
        ex, formed = _forming()
        ex.launch("b0")
        ex.open_failed("quorum 3 was broken by the coordinator")
        formed.set()
        ex.launch("tail")
        with pytest.raises(CollectiveError, match="broken by the coordinator"):
            await ex.complete(1.0, lambda: 0.0)

    asyncio.run(main())


class _Host:
    def spawn(self, coro: Any, name: str) -> Any:
        return asyncio.get_running_loop().create_task(coro, name=name)


class _Factory:
    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.built: list[int] = []

    async def create(self, quorum_id: int, rank: int, world_size: int, timeout_s: float) -> _Group:
        await self.release.wait()
        self.built.append(quorum_id)
        return _Group(quorum_id)


class _Agent(QuorumGroups):
    def __init__(self, factory: _Factory) -> None:
        super().__init__(lambda address, run_id: factory)
        self.host: Any = _Host()
        self.welcome: Any = type("W", (), {"store_address": "s", "run_id": "r", "collective_timeout_s": 5.0})()
        self._lost = asyncio.Event()


def _a(quorum_id: int) -> Assignment:
    return Assignment(step=4, quorum_id=quorum_id, members=("w0", "w1"), rank=0, heal_from="", heal_address="",
                      heal_targets=(), restore_checkpoint="", write_checkpoint=False)


def test_open_exchange_returns_at_once_and_the_group_forms_on_its_own_task() -> None:
    async def main() -> None:
        factory = _Factory()
        agent = _Agent(factory)
        seen: list[str] = []
        ex = agent.open_exchange(_a(3), lambda: seen.append("formed"))
        assert ex.pg is None and ex.opening is not None
        ex.launch("b0")  # the body computes meanwhile
        await asyncio.sleep(0)
        factory.release.set()
        await ex.complete(1.0, lambda: 0.0)
        assert factory.built == [3] and seen == ["formed"] and [s[0] for s in ex.pg.started] == ["b0"]
        again = agent.open_exchange(_a(3))  # the same quorum's next step: its group is open
        assert again.pg is ex.pg and again.opening is None

    asyncio.run(main())


def test_a_quorum_broken_while_its_group_forms_fails_the_exchange() -> None:
    async def main() -> None:
        factory = _Factory()
        agent = _Agent(factory)
        ex = agent.open_exchange(_a(5))
        await asyncio.sleep(0)  # the forming task waits on the factory
        agent._quorum_broken(5, "w1 lost")
        with pytest.raises(CollectiveError, match="quorum 5 was broken"):
            await ex.complete(1.0, lambda: 0.0)

    asyncio.run(main())


def test_a_forming_cancelled_elsewhere_fails_the_vote_it_does_not_cancel_it() -> None:
    async def main() -> None:
        factory = _Factory()
        agent = _Agent(factory)
        ex = agent.open_exchange(_a(6))
        await asyncio.sleep(0)
        voting = asyncio.ensure_future(ex.complete(1.0, lambda: 0.0))
        await asyncio.sleep(0)
        ex.opening.cancel()  # e.g. a newer quorum's open_exchange let this one go
        with pytest.raises(CollectiveError, match="cancelled"):
            await voting

    asyncio.run(main())
