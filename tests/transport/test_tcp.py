"""Real sockets on loopback: authentication, bounds, garbage, versions. One bad connection never
affects another."""

import asyncio
import socket
import struct

import pytest

from phalanx.core import auth
from phalanx.core.codec import LEN, encode_body
from phalanx.core.errors import AuthError, TransportError
from phalanx.core.messages import ClientHello, Heartbeat
from phalanx.transport.tcp import TcpTransport

TOKEN = b"k" * 32


async def _echo_server(transport):
    received = []

    async def on_conn(conn):
        try:
            while True:
                m, bufs = await conn.recv()
                received.append(m)
                await conn.send(m, bufs)
        except TransportError:
            pass

    listener = await transport.listen("127.0.0.1:0", on_conn)
    return listener, received


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_authenticated_messages_and_buffers_round_trip():
    async def main():
        server = TcpTransport(TOKEN)
        listener, _ = await _echo_server(server)
        conn = await TcpTransport(TOKEN).connect(listener.address, 2)
        await conn.send(Heartbeat(seq=1, step=5), [b"\x00" * 100_000])
        m, bufs = await conn.recv()
        assert m == Heartbeat(seq=1, step=5) and bytes(bufs[0]) == b"\x00" * 100_000
    run(main())


def test_wrong_token_is_refused_and_the_server_keeps_serving():
    async def main():
        server = TcpTransport(TOKEN)
        listener, received = await _echo_server(server)
        with pytest.raises(TransportError):
            await TcpTransport(b"z" * 32).connect(listener.address, 2)
        good = await TcpTransport(TOKEN).connect(listener.address, 2)
        await good.send(Heartbeat(seq=2, step=0))
        assert (await good.recv())[0].seq == 2
        assert server.stats.rejected.get("handshake") == 1
    run(main())


async def _raw_handshake(address, token=TOKEN, version=1):
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    body = b"".join(bytes(p) for p in encode_body(ClientHello(protocol_version=version, nonce=b"n" * 16, client="raw")))
    writer.write(LEN.pack(len(body)) + auth.handshake_mac(token, body) + body)
    await writer.drain()
    return reader, writer


def test_frame_with_wrong_hmac_after_handshake_closes_only_that_connection():
    async def main():
        server = TcpTransport(TOKEN)
        listener, received = await _echo_server(server)
        bystander = await TcpTransport(TOKEN).connect(listener.address, 2)
        reader, writer = await _raw_handshake(listener.address)
        await reader.readexactly(4)  # server hello length... read and drop the rest of the reply
        await asyncio.sleep(0.05)
        body = b"".join(bytes(p) for p in encode_body(Heartbeat(seq=1, step=1)))
        writer.write(LEN.pack(len(body)) + b"\x00" * 32 + body)
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 2) is not None  # server closes: EOF
        await bystander.send(Heartbeat(seq=9, step=9))
        assert (await bystander.recv())[0].seq == 9
        await asyncio.sleep(0.05)
        assert server.stats.rejected.get("auth") == 1
        assert received == [Heartbeat(seq=9, step=9)]
    run(main())


def test_oversized_frame_is_refused_before_it_is_read():
    async def main():
        server = TcpTransport(TOKEN, max_frame_bytes=1024)
        listener, _ = await _echo_server(server)
        reader, writer = await _raw_handshake(listener.address)
        await asyncio.sleep(0.05)
        writer.write(struct.pack(">I", 10 * 1024 * 1024) + b"\x00" * 32)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 2)
        assert data is not None
        await asyncio.sleep(0.05)
        assert server.stats.rejected.get("oversized") == 1
    run(main())


def test_garbage_bytes_are_refused_at_the_handshake():
    async def main():
        server = TcpTransport(TOKEN)
        listener, _ = await _echo_server(server)
        host, port = listener.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\xff" * 64)
        await writer.drain()
        await asyncio.wait_for(reader.read(), 2)
        await asyncio.sleep(0.05)
        assert server.stats.rejected.get("handshake") == 1
    run(main())


def test_wrong_protocol_version_is_refused_with_a_clear_reason():
    async def main():
        server = TcpTransport(TOKEN)
        listener, _ = await _echo_server(server)
        reader, writer = await _raw_handshake(listener.address, version=99)
        reply = await asyncio.wait_for(reader.read(), 2)
        assert b"protocol version mismatch" in reply and b"peer speaks 99" in reply
    run(main())


def test_client_refuses_a_server_with_another_token():
    async def main():
        listener, _ = await _echo_server(TcpTransport(b"q" * 32))
        with pytest.raises((AuthError, TransportError)):
            await TcpTransport(TOKEN).connect(listener.address, 2)
    run(main())


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_send_after_the_loop_closed_the_connection_raises_a_transport_error(loop_kind):
    # The peer closed (a killed worker) and the event loop closed the transport on the EOF before
    # anyone read it: a send must say the connection is closed (TransportError), never raise
    # uvloop's RuntimeError nor drop the frame silently (asyncio). The launcher's shutdown sends
    # Shutdown to every worker it still believes connected, and found this race.
    from phalanx.core import event_loop
    from phalanx.core.errors import ConnectionClosed

    async def main():
        server = TcpTransport(TOKEN)

        async def on_conn(conn):
            sock = conn.extra("socket")  # as a SIGKILLed process's: a reset
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close("the peer goes away")

        listener = await server.listen("127.0.0.1:0", on_conn)
        conn = await TcpTransport(TOKEN).connect(listener.address, 2)
        await asyncio.sleep(0.3)  # the reset arrives and the loop closes the transport; nobody calls recv
        with pytest.raises(ConnectionClosed):
            await conn.send(Heartbeat(seq=1, step=0))
        assert conn.is_closed
        listener.close()

    event_loop.run(asyncio.wait_for(main(), 20), loop_kind)
