"""FaultyTransport: network faults injected at the Transport seam (the control plane).

Wraps any Transport (``TcpTransport``, ``SimTransport``) so that its connections behave like TCP
links through a degraded or cut network, as seen from this node:

- latency sampled per message (constant | normal | pareto, as ``sim.network.LinkModel``) from a
  seeded ``random.Random``;
- loss charged as retransmission timeouts (``RTO_S`` per lost segment): TCP never loses a
  message, it delivers it late, and everything behind it on the connection waits;
- bandwidth as serialisation delay on this node's egress (size / bytes_per_s, shared by sends);
- partitions (sides, isolate-one, one-way) *hold* traffic, not drop it, until they heal, like a
  cut link TCP keeps retransmitting into; a connect across the cut waits for the heal or times out.

Order is kept per connection and direction: one FIFO each way, with a close (FIN) queued behind
the data. Time comes from the ``now``/``sleep`` callables (the Host seam), so the simulator's
virtual clock drives it as well as the real one.

Who charges what: both ends of a worker-worker link run a FaultyTransport, so each charges only
its own sends; the coordinator's end is not wrapped, so a worker charges both directions of its
coordinator link (``unwrapped_peers``). Partitions hold in both directions on every link (holding
twice is harmless, and it also covers a peer that missed the fault).
"""

from __future__ import annotations

import asyncio
import random
import weakref
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from phalanx.core.codec import LEN, body_length, encode_body
from phalanx.core.errors import ConnectionClosed, TransportError
from phalanx.core.host import Buffers, Connection, Listener, Transport

COORDINATOR = "coordinator"  # the coordinator's node name; it (and the TCPStore) sits on side 0
RTO_S = 0.2  # retransmission timeout charged per lost segment (same as sim.network.RTO_S)
MAX_RETRANSMISSIONS = 16  # a segment lost this many times in a row is charged no further
QUEUE_DEPTH_MAX = 1024  # messages queued per connection and direction (a full TCP buffer blocks)
DRAIN_TIMEOUT_S = 60.0  # an accepted connection's queued data gets this long to go out after its handler
FRAME_OVERHEAD_BYTES = LEN.size + 32  # length prefix + HMAC of a TcpTransport frame
DISTRIBUTIONS = ("constant", "normal", "pareto")


@dataclass(frozen=True)
class LinkEffect:
    """One active degradation of this node's links (a latency, loss or bandwidth fault)."""

    latency_s: float = 0.0
    jitter_s: float = 0.0
    distribution: str = "normal"  # constant | normal | pareto (long-tailed)
    loss_probability: float = 0.0
    bandwidth_bytes_per_s: float = 0.0  # 0: not limited
    peers: frozenset[str] | None = None  # only the links to these peers; None: every link

    def applies_to(self, peer: str) -> bool:
        return self.peers is None or peer in self.peers


def sample_latency_s(mean_s: float, jitter_s: float, distribution: str, rng: random.Random) -> float:
    """One message's latency; the same formula as the simulator's ``LinkModel.sample_latency_s``."""
    if mean_s <= 0 and jitter_s <= 0:
        return 0.0
    if distribution == "constant" or jitter_s <= 0:
        return mean_s
    if distribution == "pareto":
        return mean_s + jitter_s * (rng.paretovariate(2.5) - 1.0)
    return max(mean_s * 0.1, rng.gauss(mean_s, jitter_s))


def sides_can_send(src_side: int, dst_side: int, one_way: bool) -> bool:
    """Partition rule of ``sim.network.SimNetwork.can_send``: one-way cuts only side 0 -> others."""
    if src_side == dst_side:
        return True
    return one_way and src_side != 0


class NetworkConditions:
    """What the network looks like from one node now: partition sides and link effects.

    Decisions (``can_send``, ``message_delay_s``, ``allreduce_delay_s``, ``is_cut_off``) are
    functions of this state and the seeded rng; ``wait_for_change`` lets held traffic wait for a
    heal. Shared by this node's FaultyTransport and FaultyProcessGroups.
    """

    def __init__(self, name: str, rng: random.Random) -> None:
        self.name = name
        self.rng = rng
        self._sides: dict[str, int] = {}
        self._one_way = False
        self._effects: dict[str, LinkEffect] = {}
        self._egress_free_at_s = 0.0
        self._ingress_free_at_s = 0.0  # for links whose sending end is not wrapped (the coordinator's)
        self._waiters: list[asyncio.Future[None]] = []

    # ---- changes ----
    def partition(self, sides: Mapping[str, int], one_way: bool = False) -> None:
        """Nodes not named (and always the coordinator) are on side 0."""
        self._sides = {n: s for n, s in sides.items() if s != 0 and n != COORDINATOR}
        self._one_way = one_way
        self._notify()

    def heal_partition(self) -> None:
        self._sides, self._one_way = {}, False
        self._notify()

    def set_effect(self, key: str, effect: LinkEffect) -> None:
        self._effects[key] = effect
        self._notify()

    def clear_effect(self, key: str) -> None:
        self._effects.pop(key, None)
        self._notify()

    def _notify(self) -> None:
        self.wake_waiters()

    def wake_waiters(self) -> None:
        """Wake everything waiting for a change, to re-check its condition (e.g. a local close)."""
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    async def wait_for_change(self) -> None:
        """Returns at the next partition or effect change (callers re-check their condition)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        await fut

    # ---- decisions ----
    @property
    def partitioned(self) -> bool:
        return bool(self._sides)

    def side(self, node: str) -> int:
        return self._sides.get(node, 0)

    def can_send(self, src: str, dst: str) -> bool:
        return sides_can_send(self.side(src), self.side(dst), self._one_way)

    def reachable(self, peer: str) -> bool:
        """Both directions open: what a handshake, a request/response or a collective needs."""
        return self.can_send(self.name, peer) and self.can_send(peer, self.name)

    def is_cut_off(self, peers: Iterable[str] | None) -> bool:
        """Is any of ``peers`` across the partition? None: peers unknown, any node on another side."""
        if peers is None:
            me = self.side(self.name)
            return self.partitioned and (me != 0 or any(s != me for s in self._sides.values()))
        return any(not self.reachable(p) for p in peers)

    def is_clear(self, peer: str) -> bool:
        """No effect and no cut on the link to ``peer``: traffic may pass straight through."""
        return self.reachable(peer) and not any(e.applies_to(peer) for e in self._effects.values())

    def message_delay_s(self, peer: str, nbytes: Callable[[], int], now_s: float, inbound: bool = False) -> float:
        """Delay of one message on the link with ``peer``: latency + lost segments' RTOs + serialisation
        on the sending side (this node's egress; ``inbound``: the link into this node). ``nbytes`` is
        called only when a bandwidth limit applies."""
        delay_s = 0.0
        for key in sorted(self._effects):  # sorted: the rng is drawn in a replayable order
            e = self._effects[key]
            if not e.applies_to(peer):
                continue
            delay_s += sample_latency_s(e.latency_s, e.jitter_s, e.distribution, self.rng)
            delay_s += self._rtos_s(e.loss_probability)
            if e.bandwidth_bytes_per_s > 0:
                free_at_s = self._ingress_free_at_s if inbound else self._egress_free_at_s
                free_at_s = max(now_s, free_at_s) + nbytes() / e.bandwidth_bytes_per_s
                if inbound:
                    self._ingress_free_at_s = free_at_s
                else:
                    self._egress_free_at_s = free_at_s
                delay_s += free_at_s - now_s
        return delay_s

    def allreduce_delay_s(self, peers: Collection[str] | None, world_size: int, nbytes: int) -> float:
        """Extra time of a ring all-reduce over links with these effects (alpha-beta, like
        ``sim.process_group.CollectiveModel``): 2(n-1) messages in sequence, each paying latency
        and its lost segments, plus 2(n-1)/n x bytes / bandwidth."""
        if world_size <= 1:
            return 0.0
        steps = 2 * (world_size - 1)
        delay_s = 0.0
        for key in sorted(self._effects):
            e = self._effects[key]
            if peers is not None and e.peers is not None and not any(p in e.peers for p in peers):
                continue
            for _ in range(steps):
                delay_s += sample_latency_s(e.latency_s, e.jitter_s, e.distribution, self.rng)
                delay_s += self._rtos_s(e.loss_probability)
            if e.bandwidth_bytes_per_s > 0:
                delay_s += steps / world_size * nbytes / e.bandwidth_bytes_per_s
        return delay_s

    def _rtos_s(self, probability: float) -> float:
        lost = 0
        while probability > 0 and lost < MAX_RETRANSMISSIONS and self.rng.random() < probability:
            lost += 1
        return lost * RTO_S


async def wait_until(conditions: NetworkConditions, ok: Callable[[], bool]) -> None:
    """Hold until ``ok()`` (a partition healed). Bounded by the partition itself: every partition
    has a ``for_s``, and a closed connection cancels its waiting pump."""
    while not ok():
        await conditions.wait_for_change()


def frame_bytes(message: Any, buffers: Buffers) -> int:
    return body_length(encode_body(message, buffers)) + FRAME_OVERHEAD_BYTES


class FaultyConnection:
    """One wrapped connection: an outbound FIFO (sender task) and an inbound FIFO (reader task)."""

    def __init__(self, inner: Connection, peer_name: str, transport: "FaultyTransport", charge_inbound: bool) -> None:
        self.inner = inner
        self.peer = inner.peer
        self.peer_name = peer_name
        self._t = transport
        self._cond = transport.conditions
        self._charge_inbound = charge_inbound
        self._out: asyncio.Queue[Any] = asyncio.Queue(QUEUE_DEPTH_MAX)
        self._in: asyncio.Queue[tuple[float, Any]] = asyncio.Queue(QUEUE_DEPTH_MAX)
        self._backlog = 0  # outbound messages queued or being sent by the sender task
        self._drained = asyncio.Event()
        self._drained.set()
        self._last_out_s = 0.0
        self._last_in_s = 0.0
        self._sender: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._head: tuple[float, Any] | None = None  # the inbound item recv() is delivering
        self._recv_lock = asyncio.Lock()
        self._closing = False
        self._failed = ""
        self._eof = False
        self.close_reason = ""

    @property
    def is_closed(self) -> bool:
        return self._closing or bool(self._failed) or self._eof

    # ---- outbound ----
    def try_send(self, message: Any) -> bool:
        if self._closing or self._failed:
            raise ConnectionClosed(f"connection to {self.peer} is closed ({self._failed or self.close_reason})")
        # nothing queued, nothing degraded: straight through, as ``send`` would go
        return self._backlog == 0 and self._cond.is_clear(self.peer_name) and self.inner.try_send(message)

    async def send(self, message: Any, buffers: Buffers = ()) -> None:
        if self._closing or self._failed:
            raise ConnectionClosed(f"connection to {self.peer} is closed ({self._failed or self.close_reason})")
        if self._backlog == 0 and self._cond.is_clear(self.peer_name):
            await self.inner.send(message, buffers)  # nothing queued, nothing degraded: straight through
            return
        now_s = self._t.now()
        delay_s = self._cond.message_delay_s(self.peer_name, lambda: frame_bytes(message, buffers), now_s)
        at_s = max(now_s + delay_s, self._last_out_s)  # FIFO: never overtake what is already queued
        self._last_out_s = at_s
        self._backlog += 1
        self._drained.clear()
        if self._sender is None:
            self._sender = asyncio.ensure_future(self._send_loop())
        await self._out.put((at_s, message, buffers))  # blocks like a full TCP send buffer

    async def _send_loop(self) -> None:
        while True:
            at_s, message, buffers = await self._out.get()
            try:
                wait_s = at_s - self._t.now()
                if wait_s > 0:
                    await self._t.sleep(wait_s)
                await wait_until(self._cond, lambda: self._cond.can_send(self._cond.name, self.peer_name))
                await self.inner.send(message, buffers)
            except TransportError as e:
                self._failed = str(e) or "send failed"
                self.inner.close(self._failed)
                self._drop_queued()
                return
            finally:
                self._backlog -= 1
                if self._backlog == 0:
                    self._drained.set()
            if self._closing and self._backlog == 0:
                self.inner.close(self.close_reason)
                return

    @property
    def has_backlog(self) -> bool:
        return self._backlog > 0 and not self._failed

    def _drop_queued(self) -> None:
        """After a failed send the rest is lost (as behind a TCP reset); unblock waiting senders."""
        while not self._out.empty():
            self._out.get_nowait()
            self._backlog -= 1
        if self._backlog <= 0:
            self._drained.set()

    async def wait_for_drain(self) -> None:
        """Until queued outbound data has gone out (or failed)."""
        if self._sender is not None and not self._sender.done():
            await self._drained.wait()

    # ---- inbound ----
    async def recv(self) -> tuple[Any, list[memoryview]]:
        async with self._recv_lock:  # one reader at a time, as on a TCP stream
            if self._closing:
                raise ConnectionClosed(f"connection to {self.peer} is closed ({self.close_reason})")
            if self._reader is None:
                self._reader = asyncio.ensure_future(self._read_loop())
            if self._head is None:
                self._head = await self._in.get()
            at_s, item = self._head  # kept until delivered, so a cancelled recv loses nothing
            wait_s = at_s - self._t.now()
            if wait_s > 0:
                await self._t.sleep(wait_s)
            await wait_until(self._cond, lambda: self._closing or self._cond.can_send(self.peer_name, self._cond.name))
            if self._closing:  # closed locally while this recv waited, as a TCP read fails then
                raise ConnectionClosed(f"connection to {self.peer} is closed ({self.close_reason})")
            self._head = None
            if isinstance(item, BaseException):
                self._eof = True
                raise item
            message, buffers = item
            if self._t.on_message is not None:
                self._t.on_message(self.peer_name, message)
            return message, buffers

    async def _read_loop(self) -> None:
        while True:
            try:
                message, buffers = await self.inner.recv()
                item: Any = (message, buffers)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # delivered to recv() in order, behind the data (FIN, RST)
                item = e
            now_s = self._t.now()
            delay_s = 0.0
            if self._charge_inbound and not isinstance(item, BaseException):
                delay_s = self._cond.message_delay_s(self.peer_name, lambda: frame_bytes(*item), now_s, inbound=True)
            at_s = max(now_s + delay_s, self._last_in_s)
            self._last_in_s = at_s
            await self._in.put((at_s, item))
            if isinstance(item, BaseException):
                return

    # ---- closing ----
    def close(self, reason: str = "closed") -> None:
        if self._closing:
            return
        self._closing = True
        self.close_reason = reason
        if self._reader is not None:
            self._reader.cancel()
        if self._in.empty():  # a recv blocked on the empty queue must wake and fail
            self._in.put_nowait((0.0, ConnectionClosed(f"connection to {self.peer} is closed ({reason})")))
        self._cond.wake_waiters()  # a recv holding an item across a partition must wake and fail
        if self._backlog == 0:
            if self._sender is not None:
                self._sender.cancel()
            self.inner.close(reason)
        # else: the sender closes the inner connection once the queue drained (FIN behind data)


class FaultyTransport:
    """The Transport seam with this node's network faults applied (see the module docstring)."""

    def __init__(self, inner: Transport, conditions: NetworkConditions, now: Callable[[], float],
                 sleep: Callable[[float], Awaitable[None]], names: Mapping[str, str] | None = None,
                 unwrapped_peers: Collection[str] = (COORDINATOR,),
                 on_message: Callable[[str, Any], None] | None = None) -> None:
        self.inner = inner
        self.conditions = conditions
        self.name = conditions.name
        self.now, self.sleep = now, sleep
        self._names: dict[str, str] = dict(names or {})  # address -> node name of what listens there
        self._unwrapped = frozenset(unwrapped_peers)
        self.on_message = on_message  # observer of every delivered message: (peer name, message)
        self._open: "weakref.WeakSet[FaultyConnection]" = weakref.WeakSet()
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop the connections live on

    def _wrap(self, conn: Connection, peer: str) -> "FaultyConnection":
        self.loop = asyncio.get_running_loop()
        fc = FaultyConnection(conn, peer, self, charge_inbound=peer in self._unwrapped)
        self._open.add(fc)
        return fc

    @property
    def has_backlog(self) -> bool:
        return any(c.has_backlog for c in list(self._open))

    async def drain(self, timeout_s: float) -> None:
        """Until every queued outbound message went out, or ``timeout_s``. A process that exits
        with data in its kernel's TCP buffers still has it delivered; a user-space queue must be
        flushed for that to hold (``train.network_faults`` calls this at exit)."""
        waits = [c.wait_for_drain() for c in list(self._open) if c.has_backlog]
        if waits:
            try:
                await asyncio.wait_for(asyncio.gather(*waits), timeout_s)
            except asyncio.TimeoutError:
                pass

    def learn_peer(self, address: str, name: str) -> None:
        """Name the node listening at ``address`` (e.g. a heal source, from QuorumAssigned)."""
        if len(self._names) > 4096:  # bounded: keep the configured names, drop learned ones
            self._names = dict(list(self._names.items())[:16])
        self._names[address] = name

    def peer_name(self, address: str) -> str:
        return self._names.get(address, address)

    async def connect(self, address: str, timeout_s: float) -> Connection:
        peer = self.peer_name(address)
        deadline_s = self.now() + timeout_s
        while not self.conditions.reachable(peer):  # SYNs vanish into the cut until it heals
            left_s = deadline_s - self.now()
            if left_s <= 0:
                raise TransportError(f"cannot connect to {address} ({peer}): timed out across a network partition")
            try:
                await asyncio.wait_for(self.conditions.wait_for_change(), left_s)
            except asyncio.TimeoutError:
                pass
        conn = await self.inner.connect(address, max(deadline_s - self.now(), 0.001))
        return self._wrap(conn, peer)

    async def listen(self, address: str, on_connection: Callable[[Connection], Awaitable[None]]) -> Listener:
        async def accepted(conn: Connection) -> None:
            name = conn.peer.split("@", 1)[0]  # TcpTransport names accepted peers "client@host:port"
            fc = self._wrap(conn, name)
            try:
                await on_connection(fc)
            finally:  # the inner transport closes the socket once we return: let queued data out
                try:
                    await asyncio.wait_for(fc.wait_for_drain(), DRAIN_TIMEOUT_S)
                except asyncio.TimeoutError:
                    pass

        return await self.inner.listen(address, accepted)
