"""The simulated network and nodes: links with latency, bandwidth, loss and partitions; nodes that
crash, freeze and restart. ``SimTransport`` implements the same Transport seam as TcpTransport, so
the production coordinator and worker run on it unchanged.

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

    def crash(self, node: SimNode) -> None:
        """SIGKILL: every task stops, every connection is reset, listeners vanish. A cancelled task
        can swallow its CancelledError (Python 3.11's wait_for does when the awaited future is
        already done), so every transport call of a dead incarnation raises CancelledError again:
        a killed process never talks again."""
        node.alive = False
        node.incarnation += 1
        for addr in node.listeners:
            self._listeners.pop(addr, None)
        node.listeners.clear()
        for c in sorted(node.connections, key=lambda c: c.cid):
            if self.process_exit_s > 0:
                asyncio.get_running_loop().call_later(self.process_exit_s, c.close, "peer process died", True)
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
        self._incarnation = local.incarnation
        # frames readable now (None: closed), and the recv() calls waiting for one: a deque and a
        # future per wait, lighter than an asyncio.Queue on every message of the simulation
        self._inbox: deque[tuple[Any, list[memoryview]] | None] = deque()
        self._readers: list[asyncio.Future[None]] = []
        self._closed = False
        self.close_reason = ""
        self._last_delivery_s = 0.0
        self._pending: deque[tuple[float, int, tuple[Any, list[memoryview]]]] = deque()
        self._sent_seq = 0  # frames (and the FIN) numbered as sent ...
        self._delivered_seq = 0  # ... and checked as delivered: TCP never reorders a connection
        self._held = False
        self._loop = asyncio.get_running_loop()
        local.connections.add(self)

    @property
    def is_closed(self) -> bool:
        return self._closed

    async def send(self, message: Any, buffers: Any = ()) -> None:
        _check_incarnation(self.local, self._incarnation)
        if self._closed:
            raise ConnectionClosed(f"connection to {self.peer} is closed ({self.close_reason})")
        bufs = [memoryview(bytes(b)) for b in buffers]  # the receiver gets its own copy
        nbytes = len(msgspec.msgpack.encode(message)) + sum(b.nbytes for b in bufs) + 40
        self.net.messages_sent += 1
        now = self._loop.time()
        # max(): a frame is readable only after every frame before it (head-of-line blocking)
        at = max(now + self.net.transmit(self.local, self.remote, nbytes, now), self._last_delivery_s)
        self._enqueue(at, (message, bufs))

    def _enqueue(self, at: float, item: Any) -> None:
        assert at >= self._last_delivery_s, "frames of one connection become readable in the order sent"
        self._last_delivery_s = at
        self._sent_seq += 1
        self._pending.append((at, self._sent_seq, item))
        self._loop.call_at(at, self._pump, self.local.incarnation)

    def _pump(self, incarnation: int) -> None:
        """Deliver due messages strictly in order (TCP): same-instant timers may run in any order,
        so each timer only nudges this FIFO; a held head (partition, frozen peer) blocks the rest."""
        other = self.other
        if other is None or other._closed or incarnation != self.local.incarnation:
            self._pending.clear()
            return
        loop = self._loop
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
            _, seq, item = self._pending.popleft()
            assert seq == self._delivered_seq + 1, f"connection {self.cid} delivered frame {seq} out of order"
            self._delivered_seq = seq
            if item is _FIN:
                other._peer_closed("peer closed the connection")
                return
            other._deliver(item)

    async def _pump_after_heal(self, incarnation: int) -> None:
        await self.net.wait_for_heal()
        self._held = False
        self._pump(incarnation)

    def _deliver(self, item: tuple[Any, list[memoryview]] | None) -> None:
        self._inbox.append(item)
        self._wake_reader()

    def _wake_reader(self) -> None:
        readers = self._readers
        while readers:
            reader = readers.pop(0)
            if not reader.done():
                reader.set_result(None)
                return

    async def recv(self) -> tuple[Any, list[memoryview]]:
        _check_incarnation(self.local, self._incarnation)
        inbox = self._inbox
        if self._closed and not inbox:
            raise ConnectionClosed(f"connection to {self.peer} is closed ({self.close_reason})")
        while not inbox:
            reader = self._loop.create_future()
            self._readers.append(reader)
            try:
                await reader
            except BaseException:
                if reader in self._readers:
                    self._readers.remove(reader)
                elif inbox:  # woken, then cancelled: pass the wake-up on
                    self._wake_reader()
                raise
        item = inbox.popleft()
        if item is None:
            inbox.appendleft(None)  # closed stays closed for every later recv
            raise ConnectionClosed(f"connection to {self.peer} is closed ({self.close_reason})")
        return item

    def close(self, reason: str = "closed", reset: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        self.close_reason = reason
        self.local.connections.discard(self)
        self._deliver(None)
        other = self.other
        if other is not None and not other._closed:
            loop = asyncio.get_running_loop()
            at = loop.time() + self.net.link_between(self.local, self.remote).latency_s
            if reset:  # RST: pending data is lost, the peer learns at once
                self._pending.clear()
                loop.call_at(at, other._peer_closed, reason)
            else:  # FIN: ordered after everything already sent
                self._enqueue(max(at, self._last_delivery_s), _FIN)

    def _peer_closed(self, reason: str) -> None:
        if not self._closed:
            self.close(reason)


class SimTransport:
    """The Transport seam for one simulated node."""

    def __init__(self, net: SimNetwork, node: SimNode) -> None:
        self.net, self.node = net, node
        self.incarnation = node.incarnation

    async def connect(self, address: str, timeout_s: float) -> SimConnection:
        _check_incarnation(self.node, self.incarnation)
        target = self.net.lookup(address)
        if target is None or not target[0].alive:
            await asyncio.sleep(self.net.link.latency_s * 2)
            raise TransportError(f"cannot connect to {address}: connection refused")
        server, on_connection = target
        if not self.net.can_send(self.node, server) or not self.net.can_send(server, self.node):
            await asyncio.sleep(timeout_s)  # SYNs vanish into the partition
            raise TransportError(f"cannot connect to {address}: timed out")
        await asyncio.sleep(2 * self.net.link_between(self.node, server).sample_latency_s(self.net.rng))
        _check_incarnation(self.node, self.incarnation)
        if self.net.lookup(address) is not target:  # the server died during the handshake
            raise TransportError(f"cannot connect to {address}: connection reset")
        client = SimConnection(self.net, self.node, server, address)
        srv = SimConnection(self.net, server, self.node, self.node.name)
        client.other, srv.other = srv, client
        self.net.spawn(server, on_connection(srv), f"serve-{self.node.name}")
        return client

    async def listen(self, address: str, on_connection: Callable[[Any], Awaitable[None]]) -> Any:
        _check_incarnation(self.node, self.incarnation)
        return _SimListener(self.net, self.net.listen(self.node, on_connection, address))


def _check_incarnation(node: SimNode, incarnation: int) -> None:
    if node.incarnation != incarnation:
        raise asyncio.CancelledError(f"{node.name} was killed: its old process cannot use the network")


class _SimListener:
    def __init__(self, net: SimNetwork, address: str) -> None:
        self.net, self.address = net, address

    def close(self) -> None:
        self.net._listeners.pop(self.address, None)
