"""Simulated process groups: the ProcessGroup seam with alpha-beta collective costs.

A group is the members of one quorum id. An all-reduce completes when every member has entered
it, at the last arrival plus the closed-form cost of a ring (or tree) all-reduce, constant work
per collective, so thousands of ranks are cheap. A member that never arrives (crashed, frozen,
hung) or sits across a partition makes everyone else's collective fail at its deadline, as a real
Gloo/NCCL one does. Tensors are summed for real (numpy), in rank order; with ``cost_bytes`` the
cost is charged for a large model's gradient size instead (sizes only), the sum staying real.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from phalanx.core.errors import CollectiveError
from phalanx.sim.network import SimNetwork, SimNode


@dataclass(frozen=True)
class CollectiveModel:
    algorithm: str = "ring"  # ring | tree
    alpha_s: float = 20e-6  # per-message latency term
    beta_s_per_byte: float = 1 / 1.25e9  # inverse bandwidth
    # Building a quorum's group, beyond the two alphas of the store rendezvous: a real Gloo group
    # connects every pair of ranks once every rank has arrived (torch's new group over a TCPStore).
    # Each rank's ``create`` waits for the last rank of its quorum to arrive, as the real
    # rendezvous does, then this long. 0 (the default): no more than the rendezvous (the sweeps' model).
    group_build_s: float = 0.0

    def allreduce_s(self, world: int, nbytes: int) -> float:
        if world <= 1:
            return 0.0
        if self.algorithm == "tree":
            return 2 * math.ceil(math.log2(world)) * (self.alpha_s + nbytes * self.beta_s_per_byte)
        return 2 * (world - 1) * self.alpha_s + 2 * (world - 1) / world * nbytes * self.beta_s_per_byte


@dataclass
class _Op:
    arrivals: dict[int, tuple[np.ndarray, SimNode, int, asyncio.Future[None]]] = field(default_factory=dict)
    last_arrival_s: float = 0.0
    share: float = 0.0  # of the step's gradient (for cost_bytes)
    # ranks waiting for it: (deadline, their future); one timer for the earliest deadline serves
    # them all (not one per rank: at 1,024 ranks that was 3 timers a worker-step)
    waiters: list[tuple[float, "asyncio.Future[None]"]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    timer_at_s: float = math.inf

    def wait_until(self, deadline_s: float, fut: "asyncio.Future[None]") -> None:
        self.waiters.append((deadline_s, fut))
        if deadline_s < self.timer_at_s:
            self._arm(fut.get_loop())

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.waiters = [(d, f) for d, f in self.waiters if not f.done()]
        self.timer_at_s = min((d for d, _ in self.waiters), default=math.inf)
        if self.waiters:
            self.timer = loop.call_at(self.timer_at_s, self._expire, loop)

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        self.timer, now = None, loop.time()
        for deadline_s, fut in self.waiters:
            if deadline_s <= now and not fut.done():
                fut.set_exception(asyncio.TimeoutError())
        self._arm(loop)

    def settled(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer, self.timer_at_s = None, math.inf


class _Group:
    def __init__(self, quorum_id: int, world: int) -> None:
        self.quorum_id, self.world = quorum_id, world
        self.ops: dict[int, _Op] = {}
        self.busy_until_s = 0.0  # the group's links carry one collective at a time
        self.arrived: set[int] = set()  # the ranks that have come to build it (the rendezvous)
        self.formed: asyncio.Future[None] | None = None  # done once every rank has come

    async def rendezvous(self, rank: int, timeout_s: float) -> None:
        """Wait until every rank of the group has come to build it, as a real group's store
        rendezvous does (a rank that never comes, crashed or frozen, holds the others until their
        deadline, or until the coordinator breaks the quorum and the caller is interrupted)."""
        if self.formed is None:
            self.formed = asyncio.get_running_loop().create_future()
        self.arrived.add(rank)
        if len(self.arrived) >= self.world and not self.formed.done():
            self.formed.set_result(None)
        try:
            await asyncio.wait_for(asyncio.shield(self.formed), timeout_s)
        except asyncio.TimeoutError as e:
            raise CollectiveError(f"process group for quorum {self.quorum_id} did not form within {timeout_s:.1f} s "
                                  f"({len(self.arrived)} of {self.world} ranks came)") from e


class SimProcessGroupFactory:
    """One per cluster; every node's factory view shares the rendezvous table."""

    def __init__(self, net: SimNetwork, model: CollectiveModel, cost_bytes: int = 0) -> None:
        self.net, self.model = net, model
        # > 0: charge collectives for this many bytes (a large model's gradients, "sizes only")
        # while the arithmetic stays on the small simulated model
        self.cost_bytes = cost_bytes
        self._groups: dict[int, _Group] = {}
        self.collectives = 0

    def for_node(self, node: SimNode) -> "_NodeFactory":
        return _NodeFactory(self, node)

    def group(self, quorum_id: int, world: int) -> _Group:
        g = self._groups.get(quorum_id)
        if g is None or g.world != world:
            g = self._groups[quorum_id] = _Group(quorum_id, world)
            for old in [q for q in self._groups if q < quorum_id - 4]:
                del self._groups[old]  # bounded: old epochs are never used again
        return g


class _NodeFactory:
    def __init__(self, shared: SimProcessGroupFactory, node: SimNode) -> None:
        self.shared, self.node = shared, node

    async def create(self, quorum_id: int, rank: int, world_size: int, timeout_s: float) -> "SimProcessGroup":
        if world_size > 1:
            await self.shared.group(quorum_id, world_size).rendezvous(rank, timeout_s)
        model = self.shared.model
        # the store round trips, then every pair connecting (real runs: torch's new Gloo group)
        await asyncio.sleep(model.alpha_s * 2 + (model.group_build_s if world_size > 1 else 0.0))
        return SimProcessGroup(self.shared, self.node, quorum_id, rank, world_size)


class SimProcessGroup:
    def __init__(self, shared: SimProcessGroupFactory, node: SimNode, quorum_id: int, rank: int, world: int) -> None:
        self.shared, self.node = shared, node
        self.quorum_id, self.rank, self.world_size = quorum_id, rank, world
        self._seq = 0
        self._abandoned = False

    async def allreduce_sum(self, tensor: Any, timeout_s: float) -> None:
        await self.start_allreduce_sum(tensor).wait(timeout_s)

    def start_allreduce_sum(self, tensor: Any, share: float = 1.0) -> "_SimPending":
        """Enter the collective now (on the simulation's loop); no task or coroutine per call."""
        if self._abandoned:
            raise CollectiveError(f"process group of quorum {self.quorum_id} was abandoned")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.world_size == 1:
            fut.set_result(None)
            return _SimPending(self, fut, None)
        g = self.shared.group(self.quorum_id, self.world_size)
        seq, self._seq = self._seq, self._seq + 1
        op = g.ops.get(seq)
        if op is None:  # the first rank to arrive (setdefault would build an _Op for every rank)
            op = g.ops[seq] = _Op()
        op.arrivals[self.rank] = (tensor, self.node, self.node.incarnation, fut)
        op.share = max(op.share, share)
        op.last_arrival_s = fut.get_loop().time()
        if len(op.arrivals) == self.world_size:
            self._complete(g, seq, op)
        return _SimPending(self, fut, op)

    def _complete(self, g: _Group, seq: int, op: _Op) -> None:
        del g.ops[seq]
        members = [op.arrivals[r] for r in range(self.world_size)]
        sides = {n.side for _, n, _, _ in members}
        if len(sides) > 1 or any(not n.alive or inc != n.incarnation for _, n, inc, _ in members):
            return  # across a partition or with a dead rank: nobody completes; deadlines fire
        # rank by rank into one buffer: the same sums, in the same order, as np.sum over the stacked
        # ranks (axis 0 adds row after row), without building a ranks x length copy first (at 1,024
        # ranks the 2,049-long tail cost 45 ms a step that way)
        total = members[0][0].copy()
        for t, _, _, _ in members[1:]:
            total += t
        # sizes only: the collective stands for its share of a large model's gradient
        nbytes = int(self.shared.cost_bytes * op.share) if self.shared.cost_bytes else members[0][0].nbytes
        self.shared.collectives += 1
        loop = asyncio.get_running_loop()
        model = self.shared.model
        done_at = max(op.last_arrival_s, g.busy_until_s) + model.allreduce_s(self.world_size, nbytes)
        g.busy_until_s = done_at

        def finish() -> None:
            op.settled()
            for t, n, inc, fut in members:
                if n.alive and inc == n.incarnation and not fut.done():
                    t[...] = total
                    fut.set_result(None)
        loop.call_at(done_at, finish)

    def abandon(self) -> None:
        self._abandoned = True


class _SimPending:
    def __init__(self, group: SimProcessGroup, fut: "asyncio.Future[None]", op: _Op | None) -> None:
        self._group, self._fut, self._op = group, fut, op

    def wait_here(self, slice_s: float) -> bool:
        return True  # it completes on the simulation's loop: nothing to wait for on a thread

    def wake(self) -> None:
        return None

    async def wait(self, timeout_s: float) -> None:
        fut = self._fut
        # A bucket that finished while later ones were still computing needs no timer. Otherwise
        # the operation's one timer fails this rank's own future at its deadline (wait_for would
        # add a second future, a task wrapper and two callbacks per rank and collective).
        if not fut.done():
            assert self._op is not None, "a one-rank collective is done at once"
            self._op.wait_until(fut.get_loop().time() + timeout_s, fut)
            try:
                await fut
            except asyncio.TimeoutError as e:
                g = self._group
                g.abandon()
                arrived = len(self._op.arrivals)
                raise CollectiveError(f"all-reduce of quorum {g.quorum_id} passed its {timeout_s:.1f} s deadline "
                                      f"({arrived} of {g.world_size} ranks arrived)") from e
        fut.result()
