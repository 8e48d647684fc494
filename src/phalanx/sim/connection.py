"""Simulated TCP connections and the Transport seam on the simulated network.

Connections behave like TCP: ordered, reliable while both ends live. Each frame's delay comes from
``SimNetwork.transmit`` (egress bandwidth, latency, loss, duplicates, reordering); a frame is
readable only after every frame before it (head-of-line blocking); a partition holds traffic until
it heals (or the connection is closed); a frozen peer reads nothing until it thaws; a crashed
process's connections are reset, seen by the peer one latency later.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from phalanx.core.errors import ConnectionClosed, TransportError
from phalanx.sim.network import SimNetwork, SimNode

_cids = 0
_FIN: Any = ("fin", [])  # end-of-stream marker queued behind the data
_encode = msgspec.msgpack.Encoder().encode  # the frame's size on the wire


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
        self.try_send(message, buffers)

    def try_send(self, message: Any, buffers: Any = ()) -> bool:
        """Always at once: the simulated link's delay is the delivery time, not the sender's wait."""
        _check_incarnation(self.local, self._incarnation)
        if self._closed:
            raise ConnectionClosed(f"connection to {self.peer} is closed ({self.close_reason})")
        nbytes = len(_encode(message)) + 40
        if buffers:
            bufs = [memoryview(bytes(b)) for b in buffers]  # the receiver gets its own copy
            nbytes += sum(b.nbytes for b in bufs)
        else:  # most control messages carry none: no comprehension or generator frames
            bufs = []
        self.net.messages_sent += 1
        now = self._loop.time()
        # max(): a frame is readable only after every frame before it (head-of-line blocking)
        at = max(now + self.net.transmit(self.local, self.remote, nbytes, now), self._last_delivery_s)
        self._enqueue(at, (message, bufs))
        return True

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
