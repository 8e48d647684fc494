"""Unauthenticated and replaying peers over real loopback sockets: each gets little, is refused
quickly, is reported at a bounded rate, and never stops an authenticated peer from connecting."""

import asyncio

from phalanx.core import auth
from phalanx.core.codec import LEN, encode_body
from phalanx.core.errors import TransportError
from phalanx.core.messages import PROTOCOL_VERSION, ClientHello, Heartbeat
from phalanx.transport.tcp import HANDSHAKE_MAX_FRAME_BYTES, REJECT_REPORTS_PER_S, TcpTransport

TOKEN = b"t" * 32


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _server(**kw):
    reports = []
    transport = TcpTransport(TOKEN, on_reject=lambda peer, why: reports.append((peer, why)), **kw)
    got = []

    async def on_conn(conn):
        try:
            while True:
                m, _ = await conn.recv()
                got.append(m)
                await conn.send(m)
        except TransportError:
            pass

    listener = await transport.listen("127.0.0.1:0", on_conn)
    host, port = listener.address.rsplit(":", 1)
    return transport, listener, (host, int(port)), reports, got


async def _legit_round_trip(address):
    conn = await TcpTransport(TOKEN).connect(address, 5)
    await conn.send(Heartbeat(seq=1, step=0))
    m, _ = await conn.recv()
    conn.close()
    return m


def _hello_frame(nonce=b"n" * 16):
    body = b"".join(bytes(p) for p in encode_body(ClientHello(protocol_version=PROTOCOL_VERSION, nonce=nonce,
                                                              client="x")))
    return LEN.pack(len(body)) + auth.handshake_mac(TOKEN, body) + body


async def _closed_within(reader, timeout_s):
    """True once the server closed the connection (whatever it sent before) within timeout_s."""
    async def until_eof():
        while await reader.read(1 << 16):
            pass

    try:
        await asyncio.wait_for(until_eof(), timeout_s)
    except asyncio.TimeoutError:
        return False
    except ConnectionError:
        return True
    return True


def test_a_huge_length_before_authentication_is_refused_without_reading_it():
    async def main():
        transport, listener, (host, port), reports, _ = await _server()
        r, w = await asyncio.open_connection(host, port)
        w.write(LEN.pack(64 * 1024 * 1024) + b"\x00" * 32 + b"x" * 1000)  # announces 64 MiB
        await w.drain()
        assert await _closed_within(r, 2.0), "closed at once, nothing buffered"
        assert transport.stats.rejected.get("handshake") == 1
        assert "exceeds the limit of %d" % HANDSHAKE_MAX_FRAME_BYTES in reports[0][1]
        assert await _legit_round_trip(listener.address) == Heartbeat(seq=1, step=0)
    run(main())


def test_a_replayed_client_hello_is_refused():
    async def main():
        transport, listener, (host, port), reports, _ = await _server()
        frame = _hello_frame()
        for attempt in range(2):  # the captured hello, then the same bytes again
            r, w = await asyncio.open_connection(host, port)
            w.write(frame)
            await w.drain()
            if attempt == 0:
                head = await asyncio.wait_for(r.readexactly(LEN.size), 2)  # a ServerHello comes back
                assert LEN.unpack(head)[0] > 0
            else:
                assert await _closed_within(r, 2.0)
            w.close()
        assert any("replayed ClientHello" in why for _, why in reports)
        assert await _legit_round_trip(listener.address) == Heartbeat(seq=1, step=0)
    run(main())


def test_a_session_that_sends_nothing_after_its_handshake_is_closed_at_the_first_frame_deadline():
    async def main():
        transport, listener, (host, port), reports, _ = await _server()
        transport.first_frame_timeout_s = 0.3
        r, w = await asyncio.open_connection(host, port)
        w.write(_hello_frame(nonce=b"q" * 16))  # an accepted (e.g. replayed-once) hello, then silence
        await w.drain()
        await asyncio.wait_for(r.readexactly(LEN.size), 2)
        assert await _closed_within(r, 3.0)
        assert transport.stats.rejected.get("first_frame") == 1
    run(main())


def test_handshakes_in_progress_are_bounded_and_the_rest_closed_at_once():
    async def main():
        transport, listener, (host, port), reports, _ = await _server(handshake_timeout_s=2.0)
        transport.max_pending_handshakes = 8
        idle = [await asyncio.open_connection(host, port) for _ in range(8)]  # say nothing: hold a slot
        await asyncio.sleep(0.2)
        r, w = await asyncio.open_connection(host, port)
        assert await _closed_within(r, 1.0), "the 9th is closed at once"
        assert transport.stats.rejected.get("busy", 0) >= 1
        for _, iw in idle:
            iw.close()
        await asyncio.sleep(0.2)
        assert await _legit_round_trip(listener.address) == Heartbeat(seq=1, step=0)
    run(main())


def test_a_flood_of_refused_connections_is_reported_at_a_bounded_rate():
    async def main():
        transport, listener, (host, port), reports, _ = await _server()
        for _ in range(120):
            r, w = await asyncio.open_connection(host, port)
            w.write(b"\xff" * 40)  # garbage: fails HMAC at once
            await w.drain()
            await _closed_within(r, 2.0)
            w.close()
        await asyncio.sleep(1.1)
        r, w = await asyncio.open_connection(host, port)  # one more, in a new second: it flushes the count
        w.write(b"\xff" * 40)
        await w.drain()
        await _closed_within(r, 2.0)
        assert transport.stats.rejected["handshake"] == 121
        assert len(reports) <= 2 * REJECT_REPORTS_PER_S + 3
        assert any(peer == "*" and "more connections refused" in why for peer, why in reports)
        assert await _legit_round_trip(listener.address) == Heartbeat(seq=1, step=0)
    run(main())
