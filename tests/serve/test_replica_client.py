"""The router's keep-alive HTTP/1.1 client for unary calls: reuse, chunked answers, stale connections, garbage."""

from __future__ import annotations

import asyncio
import time

import pytest

from phalanx.core import event_loop
from phalanx.serve.asgi_server import has_fast_pair
from phalanx.serve.replica_client import Abandoned, ReplicaConnections, ReplicaProtocolError
from phalanx.serve.request_auth import NonceWindow, check_request

# the router runs on uvloop when installed (its transports are not asyncio.Transport instances): both loops
LOOPS = ["asyncio"] + (["uvloop"] if has_fast_pair() else [])


async def _server(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:])}
    return lines[0], headers, await reader.readexactly(int(headers[b"content-length"]))


@pytest.mark.parametrize("loop", LOOPS)
def test_requests_are_signed_and_reuse_one_connection(loop):
    token, seen, connections = b"k" * 32, NonceWindow(), []

    async def handler(reader, writer):
        connections.append(writer)
        for _ in range(10):
            try:
                line, headers, body = await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            ok = check_request(token, headers.get(b"x-phalanx-auth"), b"POST", line.split()[1], body, time.time(),
                               seen) is None
            out = b'{"ok": %s}' % (b"true" if ok else b"false")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nx-phalanx-model-version: v1\r\n\r\n%s" % (len(out), out))

    async def run():
        server, port = await _server(handler)
        c = ReplicaConnections(f"http://127.0.0.1:{port}", token)
        rs = [await c.post("/v1/completions", b'{"a": 1}', 5) for _ in range(3)]
        c.close()
        server.close()
        return rs

    rs = event_loop.run(run(), loop)
    assert [r.body for r in rs] == [b'{"ok": true}'] * 3 and rs[0].headers["x-phalanx-model-version"] == "v1"
    assert len(connections) == 1  # kept alive


@pytest.mark.parametrize("loop", LOOPS)
def test_chunked_answers_are_reassembled_and_a_connection_closed_while_idle_is_replaced(loop):
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 400 Bad\r\ntransfer-encoding: chunked\r\n\r\n3\r\n{\"a\r\n5\r\n\": 1}\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()  # closes after one answer, as a replica's keep-alive timeout would

    async def run():
        server, port = await _server(handler)
        c = ReplicaConnections(f"http://127.0.0.1:{port}", None)
        first = await c.post("/x", b"{}", 5)
        await asyncio.sleep(0.05)
        second = await c.post("/x", b"{}", 5)  # the pooled connection is dead: a fresh one, no error
        server.close()
        return first, second

    first, second = event_loop.run(run(), loop)
    assert first.status == 400 and first.body == b'{"a": 1}' and second.body == first.body


@pytest.mark.parametrize("loop", LOOPS)
def test_garbage_and_refused_connections_raise_typed_errors(loop):
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()

    async def run():
        server, port = await _server(handler)
        c = ReplicaConnections(f"http://127.0.0.1:{port}", None)
        with pytest.raises(ReplicaProtocolError):
            await c.post("/x", b"{}", 5)
        server.close()
        await server.wait_closed()
        with pytest.raises(ConnectionRefusedError):
            await ReplicaConnections(f"http://127.0.0.1:{port}", None).post("/x", b"{}", 5)

    event_loop.run(run(), loop)


@pytest.mark.parametrize("loop", LOOPS)
def test_an_answer_in_small_pieces_is_parsed_whole_and_a_body_until_close_is_read_to_the_end(loop):
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\nx-phalanx-model-version: v2\r\n\r\n{\"ok\": true}"

    async def pieces(reader, writer):
        await _read_request(reader)
        for i in range(0, len(answer), 7):  # the head split mid-line, the body split too
            writer.write(answer[i:i + 7])
            await writer.drain()
            await asyncio.sleep(0.002)
        await _read_request(reader)  # kept alive: the second request comes on this connection
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end")
        await writer.drain()
        writer.close()

    async def run():
        server, port = await _server(pieces)
        c = ReplicaConnections(f"http://127.0.0.1:{port}", None)
        first = await c.post("/x", b"{}", 5)
        second = await c.post("/x", b"{}", 5)
        server.close()
        return first, second, len(c.idle)

    first, second, idle = event_loop.run(run(), loop)
    assert (first.status, first.body, first.headers["x-phalanx-model-version"]) == (200, b'{"ok": true}', "v2")
    assert second.body == b"until the end" and idle == 0  # "connection: close": not pooled


@pytest.mark.parametrize("loop", LOOPS)
def test_a_request_is_abandoned_when_the_caller_says_so_and_its_connection_closes(loop):
    seen: list[bytes] = []

    async def silent(reader, writer):  # reads the request, never answers, records the close
        await _read_request(reader)
        seen.append(await reader.read())  # b"" once the client closes

    async def run():
        server, port = await _server(silent)
        c = ReplicaConnections(f"http://127.0.0.1:{port}", None)
        give_up_at = time.monotonic() + 0.2
        t0 = time.monotonic()
        with pytest.raises(Abandoned):
            await c.post("/x", b"{}", 30, abandon=lambda: time.monotonic() >= give_up_at)
        waited_s = time.monotonic() - t0
        for _ in range(200):  # bounded: the server sees the close
            if seen:
                break
            await asyncio.sleep(0.01)
        closes = list(seen)
        with pytest.raises(TimeoutError):  # and without abandon, the deadline still holds
            await c.post("/x", b"{}", 0.2)
        server.close()
        return waited_s, closes, len(c.idle)

    waited_s, closes, idle = event_loop.run(run(), loop)
    assert 0.2 <= waited_s < 20 and closes == [b""] and idle == 0
