"""FaultyProcessGroup: network faults injected at the ProcessGroup seam (the data plane).

Gloo moves tensors over its own TCP connections on loopback, which the Transport seam never sees,
so network faults on the data plane are decided here, at the seam, from the same conditions the
node's FaultyTransport uses:

- an all-reduce over degraded links is delayed by the ring's alpha-beta cost of those links
  (2(n-1) messages paying latency and lost segments' RTOs, plus 2(n-1)/n x bytes / bandwidth).
  One started early (a gradient bucket launched from backward's hooks) pays its delay from the
  moment it is started, on the control loop, while backward goes on, so overlap hides injected
  latency as it hides real latency; started collectives still enter Gloo in the order they were
  started (a delayed one holds back every later one until it is issued);
- a collective (or a group formation) that starts with a member on the other side of an active
  partition fails the way a real one does: at its deadline, with ``CollectiveError``, even if the
  partition heals meanwhile (as in the simulator: the ranks never met). The real collective is
  never called for it: it would block a Gloo thread, and a lone rank left inside a group its
  peers abandoned ends in a Gloo timeout that aborts the process at exit. The members on the
  other side fail at their own deadline because this one never joins. A collective already inside
  Gloo when the cut starts is not touched: its data moves on Gloo's own sockets.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from typing import Any, Protocol

from phalanx.collectives.process_group import ProcessGroup, ProcessGroupFactory
from phalanx.core.errors import CollectiveError

STORE_NODE = "coordinator"  # the rendezvous TCPStore lives with the coordinator (side 0)


class DataPlaneConditions(Protocol):
    """What this node's network looks like (``transport.faulty.NetworkConditions`` is one)."""

    name: str

    def is_cut_off(self, peers: Iterable[str] | None) -> bool: ...

    def allreduce_delay_s(self, peers: Collection[str] | None, world_size: int, nbytes: int) -> float: ...

    async def wait_for_change(self) -> None: ...


async def fail_at_deadline_if_cut_off(conditions: DataPlaneConditions, peers: Collection[str] | None,
                                      deadline_s: float, now: Callable[[], float],
                                      sleep: Callable[[float], Awaitable[None]], failure: str) -> None:
    """Return at once if no peer is across a partition; else raise CollectiveError(failure) at the
    deadline (cancellable meanwhile, e.g. by a broken quorum)."""
    if conditions.is_cut_off(peers):
        left_s = deadline_s - now()
        if left_s > 0:
            await sleep(left_s)
        raise CollectiveError(failure)


def tensor_bytes(tensor: Any) -> int:
    n = getattr(tensor, "nbytes", None)  # torch.Tensor and numpy arrays both have it
    return int(n) if n is not None else int(tensor.numel() * tensor.element_size())


class FaultyProcessGroup:
    def __init__(self, inner: ProcessGroup, conditions: DataPlaneConditions, peers: Sequence[str] | None,
                 now: Callable[[], float], sleep: Callable[[float], Awaitable[None]]) -> None:
        self.inner = inner
        self.quorum_id, self.rank, self.world_size = inner.quorum_id, inner.rank, inner.world_size
        self._cond = conditions
        self._peers = peers  # the other members (None: unknown)
        self._now, self._sleep = now, sleep
        self._abandoned = False
        try:  # the control loop: delayed collectives wait out their delay there
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._order = threading.Lock()  # start_allreduce_sum may be called from backward's thread
        self._unissued = 0  # delayed collectives started but not yet in the inner group
        self._last_issued: asyncio.Future[None] | None = None  # (loop side) the latest one's issue

    async def allreduce_sum(self, tensor: Any, timeout_s: float) -> None:
        if self._abandoned:
            raise CollectiveError(f"process group of quorum {self.quorum_id} was abandoned")
        deadline_s = self._now() + timeout_s
        try:
            await fail_at_deadline_if_cut_off(self._cond, self._peers, deadline_s, self._now, self._sleep,
                                              f"all-reduce in quorum {self.quorum_id} passed its {timeout_s:.1f} s deadline "
                                     f"(a member is across a network partition)")
            delay_s = self._cond.allreduce_delay_s(self._peers, self.world_size, tensor_bytes(tensor))
            if delay_s > 0:
                left_s = deadline_s - self._now()
                await self._sleep(min(delay_s, max(left_s, 0.0)))
                if delay_s >= left_s:
                    raise CollectiveError(f"all-reduce in quorum {self.quorum_id} passed its {timeout_s:.1f} s "
                                          f"deadline (slowed {delay_s:.2f} s by degraded links)")
        except CollectiveError:
            self.abandon()
            raise
        except asyncio.CancelledError:
            self.abandon()  # the step was aborted: never touch this group again
            raise
        await self.inner.allreduce_sum(tensor, max(deadline_s - self._now(), 0.001))

    def start_allreduce_sum(self, tensor: Any, share: float = 1.0) -> Any:
        """Clean links: straight into the inner group (a collective inside Gloo is not touched by
        a cut that starts later). Degraded links: started now on the control loop, which waits out
        the links' delay and then issues it (``_DelayedPending``). Cut links, or no control loop:
        None, so the caller issues it through ``allreduce_sum``, which applies the fault."""
        if self._abandoned:
            raise CollectiveError(f"process group of quorum {self.quorum_id} was abandoned")
        with self._order:
            cut = self._cond.is_cut_off(self._peers)
            delay_s = 0.0 if cut else self._cond.allreduce_delay_s(self._peers, self.world_size, tensor_bytes(tensor))
            if cut or (delay_s > 0 and self._loop is None):
                return None
            if delay_s <= 0 and self._unissued == 0:
                return self.inner.start_allreduce_sum(tensor, share)
            self._unissued += 1  # later ones (even on clean links) queue behind it: same order on every rank
            assert self._loop is not None
            started = asyncio.run_coroutine_threadsafe(self._issue_after(tensor, share, delay_s), self._loop)
        return _DelayedPending(self, started, delay_s)

    async def _issue_after(self, tensor: Any, share: float, delay_s: float) -> Any:
        """(control loop) Wait for the previous delayed collective to be issued, then this one's
        delay, then issue it. Tasks start in the order they were started, so the chain keeps it."""
        assert self._loop is not None
        previous, mine = self._last_issued, self._loop.create_future()
        self._last_issued = mine
        try:
            if previous is not None:
                await asyncio.shield(previous)
            if delay_s > 0:
                await self._sleep(delay_s)
            if self._abandoned:
                raise CollectiveError(f"process group of quorum {self.quorum_id} was abandoned")
            return self.inner.start_allreduce_sum(tensor, share)
        finally:
            with self._order:
                self._unissued -= 1
            if not mine.done():
                mine.set_result(None)

    def abandon(self) -> None:
        if not self._abandoned:
            self._abandoned = True
            self.inner.abandon()


class _DelayedPending:
    """A collective that waits out its links' delay on the control loop before entering Gloo."""

    def __init__(self, group: FaultyProcessGroup, started: Any, delay_s: float) -> None:
        self._group, self._started, self._delay_s = group, started, delay_s

    async def wait(self, timeout_s: float) -> None:
        g = self._group
        deadline_s = g._now() + timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                pending = await asyncio.wrap_future(self._started)
            if pending is None:  # the inner group refused to start it (the seam allows None)
                raise CollectiveError(f"all-reduce in quorum {g.quorum_id} could not be started")
            await pending.wait(max(deadline_s - g._now(), 0.001))
        except TimeoutError:
            self._give_up()
            raise CollectiveError(f"all-reduce in quorum {g.quorum_id} passed its {timeout_s:.1f} s deadline "
                                  f"(slowed {self._delay_s:.2f} s by degraded links)") from None
        except (CollectiveError, asyncio.CancelledError):  # cancelled: the step was aborted
            self._give_up()
            raise

    def wait_here(self, slice_s: float) -> bool:
        return True  # it enters Gloo from the control loop, after its delay: only the loop waits for it

    def wake(self) -> None:
        return None

    def _give_up(self) -> None:
        """Never touch this group again, nor issue the collective if it is still waiting its delay."""
        self._started.cancel()
        self._group.abandon()


class FaultyProcessGroupFactory:
    """Wraps a ProcessGroupFactory. ``members_of(quorum_id)`` names the quorum's members (learned
    from QuorumAssigned by the caller; None when unknown, then every node counts as a peer)."""

    def __init__(self, inner: ProcessGroupFactory, conditions: DataPlaneConditions,
                 members_of: Callable[[int], Sequence[str] | None], now: Callable[[], float],
                 sleep: Callable[[float], Awaitable[None]]) -> None:
        self.inner = inner
        self._cond = conditions
        self._members_of = members_of
        self._now, self._sleep = now, sleep

    async def create(self, quorum_id: int, rank: int, world_size: int, timeout_s: float) -> ProcessGroup:
        if world_size == 1:
            return await self.inner.create(quorum_id, rank, world_size, timeout_s)
        members = self._members_of(quorum_id)
        peers = None if members is None else [m for m in members if m != self._cond.name]
        deadline_s = self._now() + timeout_s
        # Forming a group needs the store (with the coordinator) and every member: Gloo connects
        # all pairs before the constructor returns.
        await fail_at_deadline_if_cut_off(self._cond, None if peers is None else [*peers, STORE_NODE], deadline_s,
                                          self._now, self._sleep, f"process group for quorum {quorum_id} did not form within {timeout_s:.1f} s "
                                 f"(a member is across a network partition)")
        pg = await self.inner.create(quorum_id, rank, world_size, max(deadline_s - self._now(), 0.001))
        return FaultyProcessGroup(pg, self._cond, peers, self._now, self._sleep)
