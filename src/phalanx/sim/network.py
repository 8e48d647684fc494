"""The simulated network and nodes: links with latency, bandwidth, loss and partitions; nodes that
crash, freeze and restart. ``SimTransport`` implements the same Transport seam as TcpTransport, so
the production coordinator and worker run on it unchanged.

Connections behave like TCP: ordered, reliable while both ends live. A lost packet costs a
retransmission timeout; a partition holds traffic until it heals (or the connection is closed); a
crashed process's connections are reset, seen by the peer one latency later.
"""

from __future__ import annotations

import asyncio
import contextvars
import random
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from phalanx.core.errors import ConnectionClosed, TransportError

_current_node: contextvars.ContextVar["SimNode | None"] = contextvars.ContextVar("sim_node", default=None)
RTO_S = 0.2  # retransmission timeout charged per lost packet


@dataclass
class LinkModel:
    latency_s: float = 0.0002
    jitter_s: float = 0.00005
    distribution: str = "normal"  # constant | normal | pareto (long-tailed)
    bandwidth_bytes_per_s: float = 1.25e9  # 10 Gbit/s
    loss: float = 0.0

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
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    connections: set["SimConnection"] = field(default_factory=set)
    listeners: list[str] = field(default_factory=list)


class SimNetwork:
    def __init__(self, seed: int, link: LinkModel | None = None, racks: int = 1,
                 cross_rack: LinkModel | None = None) -> None:
        self.rng = random.Random(f"net:{seed}")
        self.link = link or LinkModel()
        self.cross_rack = cross_rack or LinkModel(latency_s=self.link.latency_s * 5, jitter_s=self.link.jitter_s * 5,
                                                  bandwidth_bytes_per_s=self.link.bandwidth_bytes_per_s / 4)
        self.racks = racks
        self.nodes: dict[str, SimNode] = {}
        self._listeners: dict[str, tuple[SimNode, Callable[[Any], Awaitable[None]]]] = {}
        self._one_way: set[tuple[int, int]] = set()  # (from side, to side) pairs that drop
        self._ports = 0
        self.bytes_sent = 0
        self.messages_sent = 0
        self.partitioned = False
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
                node.tasks.add(task)
                task.add_done_callback(node.tasks.discard)
            return task
        loop.set_task_factory(factory)

    def crash(self, node: SimNode) -> None:
        """SIGKILL: every task stops, every connection is reset, listeners vanish."""
        node.alive = False
        node.incarnation += 1
        for addr in node.listeners:
            self._listeners.pop(addr, None)
        node.listeners.clear()
        for c in sorted(node.connections, key=lambda c: c.cid):
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
        return self.link if a.rack == b.rack else self.cross_rack

    def transfer_delay_s(self, a: SimNode, b: SimNode, nbytes: int, now: float) -> float:
        """Latency plus serialisation on the sender's egress link (shared by concurrent sends)."""
        link = self.link_between(a, b)
        start = max(now, a.egress_free_at_s)
        a.egress_free_at_s = start + nbytes / link.bandwidth_bytes_per_s
        delay = (a.egress_free_at_s - now) + link.sample_latency_s(self.rng)
        while link.loss > 0 and self.rng.random() < link.loss:
            delay += RTO_S
        return delay

    async def wait_for_heal(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._heal_waiters.append(fut)
        await fut

    # ---- listeners ----
    def listen(self, node: SimNode, on_connection: Callable[[Any], Awaitable[None]]) -> str:
        self._ports += 1
        addr = f"{node.name}:{self._ports}"
        self._listeners[addr] = (node, on_connection)
        node.listeners.append(addr)
        return addr

    def lookup(self, address: str) -> tuple[SimNode, Callable[[Any], Awaitable[None]]] | None:
        return self._listeners.get(address)


_cids = 0
_FIN: Any = ("fin", [])  # end-of-stream marker queued behind the data


class SimConnection:
    """One end of a simulated TCP connection."""

    def __init__(self, net: SimNetwork, local: SimNode, remote: SimNode, peer: str) -> None:
        global _cids
        _cids += 1
        self.cid = _cids
        self.net, self.local, self.remote, self.peer = net, local, remote, peer
        self.other: SimConnection | None = None
        self._inbox: asyncio.Queue[tuple[Any, list[memoryview]] | None] = asyncio.Queue()
        self._closed = False
        self.close_reason = ""
        self._last_delivery_s = 0.0
        self._pending: deque[tuple[float, tuple[Any, list[memoryview]]]] = deque()
        self._held = False
        local.connections.add(self)

    @property
    def is_closed(self) -> bool:
        return self._closed

    async def send(self, message: Any, buffers: Any = ()) -> None:
        if self._closed:
            raise ConnectionClosed(f"connection to {self.peer} is closed ({self.close_reason})")
        bufs = [memoryview(bytes(b)) for b in buffers]  # the receiver gets its own copy
        nbytes = len(msgspec.msgpack.encode(message)) + sum(b.nbytes for b in bufs) + 40
        self.net.bytes_sent += nbytes
        self.net.messages_sent += 1
        loop = asyncio.get_running_loop()
        now = loop.time()
        at = max(now + self.net.transfer_delay_s(self.local, self.remote, nbytes, now), self._last_delivery_s)
        self._last_delivery_s = at
        self._pending.append((at, (message, bufs)))
        loop.call_at(at, self._pump, self.local.incarnation)

    def _pump(self, incarnation: int) -> None:
        """Deliver due messages strictly in order (TCP): same-instant timers may run in any order,
        so each timer only nudges this FIFO; a held head (partition, frozen peer) blocks the rest."""
        other = self.other
        if other is None or other._closed or incarnation != self.local.incarnation:
            self._pending.clear()
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._pending and self._pending[0][0] <= now:
            if not self.net.can_send(self.local, self.remote):
                if not self._held:
                    self._held = True  # TCP keeps retransmitting; delivered once the partition heals
                    loop.create_task(self._pump_after_heal(incarnation))
                return
            if self.remote.frozen_until_s > now:
                loop.call_at(self.remote.frozen_until_s, self._pump, incarnation)
                return
            item = self._pending.popleft()[1]
            if item is _FIN:
                other._peer_closed("peer closed the connection")
                return
            other._inbox.put_nowait(item)

    async def _pump_after_heal(self, incarnation: int) -> None:
        await self.net.wait_for_heal()
        self._held = False
        self._pump(incarnation)

    async def recv(self) -> tuple[Any, list[memoryview]]:
        if self._closed and self._inbox.empty():
            raise ConnectionClosed(f"connection to {self.peer} is closed ({self.close_reason})")
        item = await self._inbox.get()
        if item is None:
            raise ConnectionClosed(f"connection to {self.peer} is closed ({self.close_reason})")
        return item

    def close(self, reason: str = "closed", reset: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        self.close_reason = reason
        self.local.connections.discard(self)
        self._inbox.put_nowait(None)
        other = self.other
        if other is not None and not other._closed:
            loop = asyncio.get_running_loop()
            at = loop.time() + self.net.link_between(self.local, self.remote).latency_s
            if reset:  # RST: pending data is lost, the peer learns at once
                self._pending.clear()
                loop.call_at(at, other._peer_closed, reason)
            else:  # FIN: ordered after everything already sent
                at = max(at, self._last_delivery_s)
                self._pending.append((at, _FIN))
                loop.call_at(at, self._pump, self.local.incarnation)

    def _peer_closed(self, reason: str) -> None:
        if not self._closed:
            self.close(reason)


class SimTransport:
    """The Transport seam for one simulated node."""

    def __init__(self, net: SimNetwork, node: SimNode) -> None:
        self.net, self.node = net, node

    async def connect(self, address: str, timeout_s: float) -> SimConnection:
        target = self.net.lookup(address)
        if target is None or not target[0].alive:
            await asyncio.sleep(self.net.link.latency_s * 2)
            raise TransportError(f"cannot connect to {address}: connection refused")
        server, on_connection = target
        if not self.net.can_send(self.node, server) or not self.net.can_send(server, self.node):
            await asyncio.sleep(timeout_s)  # SYNs vanish into the partition
            raise TransportError(f"cannot connect to {address}: timed out")
        await asyncio.sleep(2 * self.net.link_between(self.node, server).sample_latency_s(self.net.rng))
        client = SimConnection(self.net, self.node, server, address)
        srv = SimConnection(self.net, server, self.node, self.node.name)
        client.other, srv.other = srv, client
        self.net.spawn(server, on_connection(srv), f"serve-{self.node.name}")
        return client

    async def listen(self, address: str, on_connection: Callable[[Any], Awaitable[None]]) -> Any:
        return _SimListener(self.net, self.net.listen(self.node, on_connection))


class _SimListener:
    def __init__(self, net: SimNetwork, address: str) -> None:
        self.net, self.address = net, address

    def close(self) -> None:
        self.net._listeners.pop(self.address, None)
