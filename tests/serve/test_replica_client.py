"""The router's keep-alive HTTP/1.1 client for unary calls: reuse, chunked answers, stale connections, garbage."""

from __future__ import annotations

import asyncio
import time

import pytest

from phalanx.serve.replica_client import ReplicaConnections, ReplicaProtocolError
from phalanx.serve.request_auth import NonceWindow, check_request


async def _server(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:])}
    return lines[0], headers, await reader.readexactly(int(headers[b"content-length"]))


def test_requests_are_signed_and_reuse_one_connection():
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

    rs = asyncio.run(run())
    assert [r.body for r in rs] == [b'{"ok": true}'] * 3 and rs[0].headers["x-phalanx-model-version"] == "v1"
    assert len(connections) == 1  # kept alive


def test_chunked_answers_are_reassembled_and_a_connection_closed_while_idle_is_replaced():
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

    first, second = asyncio.run(run())
    assert first.status == 400 and first.body == b'{"a": 1}' and second.body == first.body


def test_garbage_and_refused_connections_raise_typed_errors():
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

    asyncio.run(run())
