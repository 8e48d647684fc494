"""The simulated network and nodes: links with latency, bandwidth, loss and partitions; nodes that
crash, freeze and restart. ``sim.connection.SimTransport`` implements the same Transport seam as
TcpTransport on top of it, so the production coordinator and worker run on it unchanged.

Connections behave like TCP: ordered, reliable while both ends live. A lost packet costs a
retransmission timeout; a partition holds traffic until it heals (or the connection is closed); a
crashed process's connections are reset, seen by the peer one latency later. TCP hides duplicated
and reordered segments from the application, so they cost time and bytes, never order: a duplicated
frame crosses the sender's egress link twice; a reordered one is held, together with every frame
behind it on its connection (head-of-line blocking), until its late segment arrives.

Network faults are ``Impairment``s: timed overrides of link fields for every link, the links of
some nodes, or one pair of nodes; each fault adds one and removes exactly that one when it ends.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from phalanx.core.errors import TransportError

if TYPE_CHECKING:
    from phalanx.sim.connection import SimConnection

_current_node: contextvars.ContextVar["SimNode | None"] = contextvars.ContextVar("sim_node", default=None)
RTO_S = 0.2  # retransmission timeout charged per lost packet


@dataclass
class LinkModel:
    latency_s: float = 0.0002
    jitter_s: float = 0.00005
    distribution: str = "normal"  # constant | normal | pareto (long-tailed)
    bandwidth_bytes_per_s: float = 1.25e9  # 10 Gbit/s
    loss: float = 0.0  # per frame: each loss costs one retransmission timeout
    duplicate_probability: float = 0.0  # per frame: its bytes cross the link twice
    reorder_probability: float = 0.0  # per frame: a segment arrives reorder_delay_s late
    reorder_delay_s: float = 0.0

    def sample_latency_s(self, rng: random.Random) -> float:
        if self.distribution == "constant" or self.jitter_s <= 0:
            return self.latency_s
        if self.distribution == "pareto":
            return self.latency_s + self.jitter_s * (rng.paretovariate(2.5) - 1.0)
        return max(self.latency_s * 0.1, rng.gauss(self.latency_s, self.jitter_s))


@dataclass
class SimNode:
    name: str
    index: int
    rack: int = 0
    alive: bool = True
    incarnation: int = 0
    frozen_until_s: float = 0.0
    side: int = 0  # partition side; nodes on different sides cannot talk
    egress_free_at_s: float = 0.0
    tasks: dict[asyncio.Task[Any], None] = field(default_factory=dict)  # insertion-ordered: crash order replays
    connections: set["SimConnection"] = field(default_factory=set)
    listeners: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Impairment:
    """A timed override of LinkModel fields (a latency, loss, bandwidth, duplicate or reorder fault).

    Scope: every link (no nodes, no pair), the links touching any of ``nodes``, or only the link
    between the two nodes of ``pair`` (both directions). Where several cover a link, the newest wins
    field by field.
    """

    changes: tuple[tuple[str, Any], ...]
    nodes: frozenset[str] = frozenset()
    pair: frozenset[str] = frozenset()

    def covers(self, a: str, b: str) -> bool:
        if self.pair:
            return a != b and {a, b} == self.pair
        return not self.nodes or a in self.nodes or b in self.nodes


class SimNetwork:
    def __init__(self, seed: int, link: LinkModel | None = None, racks: int = 1,
                 cross_rack: LinkModel | None = None, process_exit_s: float = 0.0) -> None:
        self.rng = random.Random(f"net:{seed}")
        # How long the OS takes to tear a killed process down and reset its sockets (a process
        # with torch loaded unmaps a lot of memory first); measured by the fidelity benchmark.
        self.process_exit_s = process_exit_s
        self.link = link or LinkModel()
        self.cross_rack = cross_rack or LinkModel(latency_s=self.link.latency_s * 5, jitter_s=self.link.jitter_s * 5,
                                                  bandwidth_bytes_per_s=self.link.bandwidth_bytes_per_s / 4)
        self.racks = racks
        self.nodes: dict[str, SimNode] = {}
        self._listeners: dict[str, tuple[SimNode, Callable[[Any], Awaitable[None]]]] = {}
        self._one_way: set[tuple[int, int]] = set()  # (from side, to side) pairs that drop
        self._ports = 0
        self.bytes_sent = 0  # on the wire, duplicates included
        self.messages_sent = 0
        self.bytes_duplicated = 0
        self.frames_duplicated = 0
        self.frames_reordered = 0
        self.partitioned = False
        self._impairments: list[Impairment] = []  # oldest first
        self._impaired_links: dict[tuple[str, str], LinkModel] = {}  # cache, cleared on every change
        self._heal_waiters: list[asyncio.Future[None]] = []

    # ---- nodes ----
    def add_node(self, name: str) -> SimNode:
        idx = len(self.nodes)
        node = SimNode(name, idx, rack=idx % self.racks if self.racks > 1 else 0)
        self.nodes[name] = node
        return node

    def spawn(self, node: SimNode, coro: Any, name: str) -> asyncio.Task[Any]:
        token = _current_node.set(node)
        try:
            task = asyncio.get_running_loop().create_task(coro, name=f"{node.name}:{name}")
        finally:
            _current_node.reset(token)
        return task

    def install_task_factory(self, loop: asyncio.AbstractEventLoop) -> None:
        """Every task inherits its creator's node, so a crash can cancel all of a node's tasks."""
        def factory(loop: Any, coro: Any, **kw: Any) -> asyncio.Task[Any]:
            task = asyncio.Task(coro, loop=loop, **kw)
            ctx = kw.get("context")
            node = ctx.get(_current_node) if ctx is not None else _current_node.get()
            if node is not None:
                node.tasks[task] = None
                task.add_done_callback(lambda t: node.tasks.pop(t, None))
            return task
        loop.set_task_factory(factory)

    def crash(self, node: SimNode, process_exit_s: float | None = None) -> None:
        """SIGKILL: every task stops, every connection is reset (``process_exit_s`` after the kill:
        this crash's own teardown, else the network's), listeners vanish. A cancelled task
        can swallow its CancelledError (Python 3.11's wait_for does when the awaited future is
        already done), so every transport call of a dead incarnation raises CancelledError again:
        a killed process never talks again."""
        node.alive = False
        node.incarnation += 1
        for addr in node.listeners:
            self._listeners.pop(addr, None)
        node.listeners.clear()
        exit_s = self.process_exit_s if process_exit_s is None else process_exit_s
        for c in sorted(node.connections, key=lambda c: c.cid):
            if exit_s > 0:
                asyncio.get_running_loop().call_later(exit_s, c.close, "peer process died", True)
            else:
                c.close("peer process died", reset=True)
        for t in list(node.tasks):
            t.cancel()
        node.tasks.clear()

    def revive(self, node: SimNode) -> None:
        node.alive, node.frozen_until_s = True, 0.0

    # ---- partitions and link changes ----
    def partition(self, sides: dict[str, int], one_way: bool = False) -> None:
        """Assign nodes to sides (unlisted nodes stay on side 0). one_way: only side 0 -> others drops."""
        for n in self.nodes.values():
            n.side = sides.get(n.name, 0)
        self._one_way = {(0, s) for s in set(sides.values()) if s != 0} if one_way else set()
        self.partitioned = True

    def heal_partition(self) -> None:
        for n in self.nodes.values():
            n.side = 0
        self._one_way = set()
        self.partitioned = False
        waiters, self._heal_waiters = self._heal_waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    def can_send(self, a: SimNode, b: SimNode) -> bool:
        if a.side == b.side:
            return True
        return bool(self._one_way) and (a.side, b.side) not in self._one_way

    def link_between(self, a: SimNode, b: SimNode) -> LinkModel:
        base = self.link if a.rack == b.rack else self.cross_rack
        if not self._impairments:
            return base
        key = (a.name, b.name)
        link = self._impaired_links.get(key)
        if link is None:
            changes: dict[str, Any] = {}
            for imp in self._impairments:
                if imp.covers(a.name, b.name):
                    changes.update(imp.changes)
            link = self._impaired_links[key] = dataclasses.replace(base, **changes) if changes else base
        return link

    def impair(self, imp: Impairment) -> None:
        self._impairments.append(imp)
        self._impaired_links.clear()

    def restore(self, imp: Impairment) -> None:
        self._impairments.remove(imp)
        self._impaired_links.clear()

    def transmit(self, a: SimNode, b: SimNode, nbytes: int, now: float) -> float:
        """One frame from a to b: returns its delay until b may read it, and charges a's egress link
        (shared by concurrent sends) and the byte counters."""
        link = self.link_between(a, b)
        start = max(now, a.egress_free_at_s)
        sent_at_s = start + nbytes / link.bandwidth_bytes_per_s
        a.egress_free_at_s = sent_at_s
        self.bytes_sent += nbytes
        delay = (sent_at_s - now) + link.sample_latency_s(self.rng)
        while link.loss > 0 and self.rng.random() < link.loss:
            delay += RTO_S
        if link.duplicate_probability > 0 and self.rng.random() < link.duplicate_probability:
            # the copy follows the original onto the wire: later frames wait for it, this one does not
            a.egress_free_at_s += nbytes / link.bandwidth_bytes_per_s
            self.bytes_sent += nbytes
            self.bytes_duplicated += nbytes
            self.frames_duplicated += 1
        if link.reorder_probability > 0 and self.rng.random() < link.reorder_probability:
            delay += link.reorder_delay_s  # the receiver's TCP holds the data until the gap fills
            self.frames_reordered += 1
        return delay

    async def wait_for_heal(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._heal_waiters.append(fut)
        await fut

    # ---- listeners ----
    def listen(self, node: SimNode, on_connection: Callable[[Any], Awaitable[None]], bind: str = "") -> str:
        """Listen at ``bind`` if it is one of this node's own ``name:port`` addresses (a restarted
        server rebinding its port), else at a fresh port (like binding port 0)."""
        host, _, port = bind.rpartition(":")
        if host == node.name and port.isdigit() and int(port) > 0:
            addr = bind
            if addr in self._listeners:
                raise TransportError(f"cannot listen on {addr}: address already in use")
        else:
            self._ports += 1
            addr = f"{node.name}:{self._ports}"
        self._listeners[addr] = (node, on_connection)
        node.listeners.append(addr)
        return addr

    def lookup(self, address: str) -> tuple[SimNode, Callable[[Any], Awaitable[None]]] | None:
        return self._listeners.get(address)

