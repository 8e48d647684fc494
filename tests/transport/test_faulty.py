"""FaultyTransport on an in-memory transport and the virtual clock: order, holds, one-way, loss."""

import asyncio
import random

import pytest

from phalanx.core.errors import ConnectionClosed, TransportError
from phalanx.core.messages import Heartbeat
from phalanx.sim.loop import run_virtual
from phalanx.transport.faulty import RTO_S, FaultyTransport, LinkEffect, NetworkConditions


class MemConnection:
    """Zero-latency, ordered, in-memory connection end (a fake, not a mock)."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.other: "MemConnection | None" = None
        self.inbox: asyncio.Queue = asyncio.Queue()
        self._closed = False

    @property
    def is_closed(self) -> bool:
        return self._closed

    async def send(self, message, buffers=()):
        if self._closed:
            raise ConnectionClosed("closed")
        self.other.inbox.put_nowait((message, [memoryview(bytes(b)) for b in buffers]))

    async def recv(self):
        item = await self.inbox.get()
        if item is None:
            self._closed = True
            raise ConnectionClosed(f"{self.peer} closed the connection")
        return item

    def close(self, reason="closed"):
        if not self._closed:
            self._closed = True
            self.other.inbox.put_nowait(None)


class MemListener:
    def __init__(self, address):
        self.address = address

    def close(self):
        pass


class MemNet:
    def __init__(self):
        self.listeners = {}


class MemTransport:
    def __init__(self, net: MemNet, name: str) -> None:
        self.net, self.name = net, name

    async def connect(self, address, timeout_s):
        if address not in self.net.listeners:
            raise TransportError(f"cannot connect to {address}")
        client, server = MemConnection(address), MemConnection(f"{self.name}@mem")
        client.other, server.other = server, client
        asyncio.ensure_future(self.net.listeners[address](server))
        return client

    async def listen(self, address, on_connection):
        self.net.listeners[address] = on_connection
        return MemListener(address)


def faulty(net: MemNet, name: str, seed: int = 1) -> FaultyTransport:
    loop = asyncio.get_running_loop()
    cond = NetworkConditions(name, random.Random(seed))
    return FaultyTransport(MemTransport(net, name), cond, loop.time, asyncio.sleep, names={"coord:1": "coordinator"})


async def coordinator(net: MemNet, received: list, replies: list | None = None):
    """An unwrapped coordinator at coord:1: records (time, message) and sends ``replies`` on accept."""
    loop = asyncio.get_running_loop()

    async def on_conn(conn):
        for r in replies or []:
            await conn.send(r)
        try:
            while True:
                m, _ = await conn.recv()
                received.append((loop.time(), m))
        except TransportError:
            received.append((loop.time(), "closed"))

    await MemTransport(net, "coordinator").listen("coord:1", on_conn)


def beats(n):
    return [Heartbeat(seq=i, step=0) for i in range(n)]


def test_messages_keep_their_order_under_heavy_jitter():
    async def main():
        net, got = MemNet(), []
        await coordinator(net, got)
        w = faulty(net, "w0")
        w.conditions.set_effect("latency", LinkEffect(latency_s=0.02, jitter_s=0.015, distribution="pareto"))
        conn = await w.connect("coord:1", 1)
        t0 = asyncio.get_running_loop().time()
        for m in beats(200):
            await conn.send(m)
            await asyncio.sleep(0.001)
        await asyncio.sleep(2)
        return t0, got

    (t0, got), _ = run_virtual(main())
    assert [m.seq for _, m in got] == list(range(200))
    assert got[0][0] - t0 >= 0.02  # the latency was charged


def test_a_clear_link_passes_messages_straight_through():
    async def main():
        net, got = MemNet(), []
        await coordinator(net, got)
        conn = await faulty(net, "w0").connect("coord:1", 1)
        t0 = asyncio.get_running_loop().time()
        await conn.send(Heartbeat(seq=1, step=0))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return t0, got

    (t0, got), _ = run_virtual(main())
    assert got == [(t0, Heartbeat(seq=1, step=0))]


def test_a_partition_holds_traffic_both_ways_until_it_heals_then_delivers_it_in_order():
    async def main():
        net, got = MemNet(), []
        await coordinator(net, got, replies=beats(3))
        w = faulty(net, "w1")
        conn = await w.connect("coord:1", 1)
        loop = asyncio.get_running_loop()
        w.conditions.partition({"w1": 1})
        for m in beats(5):
            await conn.send(m)
        inbound = []

        async def read():
            while True:
                m, _ = await conn.recv()
                inbound.append((loop.time(), m.seq))

        reader = asyncio.ensure_future(read())
        await asyncio.sleep(2.0)
        during = (list(got), list(inbound))
        w.conditions.heal_partition()
        healed_at = loop.time()
        await asyncio.sleep(0.1)
        reader.cancel()
        return during, got, inbound, healed_at

    (during, got, inbound, healed_at), _ = run_virtual(main())
    assert during == ([], [])  # nothing crossed the cut, in either direction
    assert [m.seq for _, m in got] == [0, 1, 2, 3, 4] and all(t >= healed_at for t, _ in got)
    assert [s for _, s in inbound] == [0, 1, 2] and all(t >= healed_at for t, _ in inbound)


def test_a_one_way_partition_cuts_only_the_coordinator_side_to_the_minority():
    async def main():
        net, got = MemNet(), []
        await coordinator(net, got, replies=beats(1))
        w = faulty(net, "w1")
        conn = await w.connect("coord:1", 1)
        w.conditions.partition({"w1": 1}, one_way=True)
        await conn.send(Heartbeat(seq=7, step=0))
        try:
            await asyncio.wait_for(conn.recv(), 1.0)
            heard = True
        except asyncio.TimeoutError:
            heard = False
        return got, heard

    (got, heard), _ = run_virtual(main())
    assert [m.seq for _, m in got] == [7]  # minority -> coordinator still flows
    assert not heard  # coordinator -> minority is held


def test_loss_is_charged_as_retransmission_delay_and_never_drops_a_message():
    async def main():
        net, got = MemNet(), []
        await coordinator(net, got)
        w = faulty(net, "w0", seed=3)
        w.conditions.set_effect("loss", LinkEffect(loss_probability=0.3))
        conn = await w.connect("coord:1", 1)
        loop = asyncio.get_running_loop()
        sent = []
        for m in beats(100):
            sent.append(loop.time())
            await conn.send(m)
            await asyncio.sleep(4.0)  # > 16 RTOs apart: no message waits behind an earlier one
        await asyncio.sleep(5)
        return sent, got

    (sent, got), _ = run_virtual(main())
    assert [m.seq for _, m in got] == list(range(100))
    delays = [t - s for (t, _), s in zip(got, sent)]
    late = [d for d in delays if d > 1e-9]
    assert late and all(d == pytest.approx(RTO_S * round(d / RTO_S)) for d in late)
    assert 10 <= len(late) <= 50  # about 30 % of messages lost at least once


def test_bandwidth_delays_a_message_by_its_size():
    async def main():
        net, got = MemNet(), []
        await coordinator(net, got)
        w = faulty(net, "w0")
        w.conditions.set_effect("bandwidth", LinkEffect(bandwidth_bytes_per_s=10_000))
        conn = await w.connect("coord:1", 1)
        t0 = asyncio.get_running_loop().time()
        await conn.send(Heartbeat(seq=1, step=0), [b"x" * 5_000])
        await asyncio.sleep(2)
        return t0, got

    (t0, got), _ = run_virtual(main())
    assert len(got) == 1 and 0.5 < got[0][0] - t0 < 0.6


def test_a_connect_across_the_partition_times_out_and_succeeds_once_it_healed():
    async def main():
        net, got = MemNet(), []
        await coordinator(net, got)
        w = faulty(net, "w1")
        w.conditions.partition({"w1": 1})
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TransportError, match="partition"):
            await w.connect("coord:1", 1.5)
        failed_after = loop.time() - t0
        loop.call_later(0.5, w.conditions.heal_partition)
        conn = await w.connect("coord:1", 2.0)
        return failed_after, conn.peer_name, loop.time() - t0

    (failed_after, name, t), _ = run_virtual(main())
    assert failed_after == pytest.approx(1.5) and name == "coordinator" and t == pytest.approx(2.0)


def test_close_is_queued_behind_held_data():
    async def main():
        net, got = MemNet(), []
        await coordinator(net, got)
        w = faulty(net, "w0")
        w.conditions.set_effect("latency", LinkEffect(latency_s=0.3, distribution="constant"))
        conn = await w.connect("coord:1", 1)
        for m in beats(3):
            await conn.send(m)
        conn.close()
        assert conn.is_closed
        with pytest.raises(ConnectionClosed):
            await conn.send(Heartbeat(seq=9, step=0))
        await asyncio.sleep(1)
        return got

    got, _ = run_virtual(main())
    assert [m if isinstance(m, str) else m.seq for _, m in got] == [0, 1, 2, "closed"]


def test_a_worker_to_worker_link_is_charged_once_by_the_sender_and_named_from_the_handshake():
    async def main():
        net = MemNet()
        loop = asyncio.get_running_loop()
        a, b = faulty(net, "w0"), faulty(net, "w1")
        for t in (a, b):
            t.conditions.set_effect("latency", LinkEffect(latency_s=0.05, distribution="constant"))
        got, names = [], []

        async def serve(conn):
            names.append(conn.peer_name)
            m, _ = await conn.recv()
            got.append(loop.time())
            await conn.send(m)

        await b.listen("w1:9", serve)
        a.learn_peer("w1:9", "w1")
        conn = await a.connect("w1:9", 1)
        t0 = loop.time()
        await conn.send(Heartbeat(seq=1, step=0))
        await conn.recv()
        return got[0] - t0, loop.time() - t0, names, conn.peer_name

    (one_way, round_trip, names, peer), _ = run_virtual(main())
    assert one_way == pytest.approx(0.05) and round_trip == pytest.approx(0.10)
    assert names == ["w0"] and peer == "w1"


def test_a_partition_between_workers_holds_heal_traffic_but_not_traffic_within_a_side():
    async def main():
        net = MemNet()
        w0, w1, w2 = faulty(net, "w0"), faulty(net, "w1"), faulty(net, "w2")
        for t in (w0, w1, w2):
            t.conditions.partition({"w2": 1})
        got = []

        async def serve(conn):
            m, _ = await conn.recv()
            got.append((conn.peer_name, m.seq))

        await w0.listen("w0:9", serve)
        for t, seq in ((w1, 1), (w2, 2)):
            t.learn_peer("w0:9", "w0")
        c1 = await w1.connect("w0:9", 1)
        await c1.send(Heartbeat(seq=1, step=0))
        with pytest.raises(TransportError):
            await w2.connect("w0:9", 1)
        await asyncio.sleep(0.1)
        return got

    got, _ = run_virtual(main())
    assert got == [("w1", 1)]


def test_a_local_close_fails_a_recv_that_is_waiting_or_held_by_a_partition():
    async def main():
        net, got = MemNet(), []
        await coordinator(net, got, replies=beats(1))
        w = faulty(net, "w1")
        conn = await w.connect("coord:1", 1)
        w.conditions.partition({"w1": 1})  # the coordinator's reply is held at our end
        held = asyncio.ensure_future(conn.recv())
        await asyncio.sleep(0.5)
        conn.close()
        return await asyncio.gather(held, return_exceptions=True)

    results, _ = run_virtual(main())
    assert isinstance(results[0], ConnectionClosed)


def test_a_local_close_fails_a_recv_waiting_on_a_silent_peer():
    async def main():
        net, got = MemNet(), []
        await coordinator(net, got)
        conn = await faulty(net, "w0").connect("coord:1", 1)
        waiting = asyncio.ensure_future(conn.recv())
        await asyncio.sleep(0.5)
        conn.close()
        return await asyncio.gather(waiting, return_exceptions=True)

    results, _ = run_virtual(main())
    assert isinstance(results[0], ConnectionClosed)
