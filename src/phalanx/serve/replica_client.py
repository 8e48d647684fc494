"""The router's unary calls to a replica: signed HTTP/1.1 over a small pool of keep-alive connections.

Why not httpx here: its connection pool checks every pooled connection (``has_expired``, a socket
poll and ``getpeername`` each) on every request, which was half of the router's 5 ms of CPU per
request at 200 req/s. A replica is one host; requests are small JSON bodies with a Content-Length
answer; so a list of idle connections per replica, reused last-in first-out, is all it takes.
Health polls use it too (10 a second per replica: through httpx they cost as much as 25 requests).
Streams keep using httpx (its cost is spread over a whole generation).

A connection is returned to the pool only after a complete response; a cancelled request (a hedge
that lost, a replica voted out) closes its connection, which the replica sees as a disconnect and
cancels the generation.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from phalanx.core.auth import new_nonce
from phalanx.serve.request_auth import AUTH_HEADER, sign_request

IDLE_CONNECTIONS_MAX = 64  # per replica; more concurrent requests open more, closed after use
HEAD_BYTES_MAX = 64 * 1024
BODY_BYTES_MAX = 16 << 20


class ReplicaProtocolError(ConnectionError):
    """The replica's answer was not valid HTTP/1.1 (or too large): treated like a dropped connection."""


@dataclass(frozen=True)
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class ReplicaConnections:
    def __init__(self, url: str, token: bytes | None) -> None:
        assert url.startswith("http://"), url
        hostport = url.removeprefix("http://").rstrip("/")
        host, _, port = hostport.rpartition(":")
        self.host, self.port, self.token = host, int(port), token
        self.host_header = hostport.encode()
        self.idle: list[Conn] = []

    async def post(self, path: str, body: bytes, timeout_s: float, connect_timeout_s: float = 0.5) -> RawResponse:
        return await self.request(b"POST", path, body, timeout_s, connect_timeout_s)

    async def get(self, path: str, timeout_s: float) -> RawResponse:
        return await self.request(b"GET", path, b"", timeout_s, timeout_s)

    async def request(self, method: bytes, path: str, body: bytes, timeout_s: float, connect_timeout_s: float
                      ) -> RawResponse:
        """One request. Raises ConnectionRefusedError (nothing listens: the replica is gone), ConnectionError or
        asyncio.IncompleteReadError (dropped mid-request), TimeoutError, ReplicaProtocolError."""
        head = self._head(method, path, body)
        for reused in (True, False):  # a pooled connection the replica closed while idle: once more on a fresh one
            conn = self.idle.pop() if reused and self.idle else None
            if conn is None:
                reused = False
                conn = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), connect_timeout_s)
            try:
                async with asyncio.timeout(timeout_s):
                    conn[1].write(head + body)
                    resp, keep = await _read_response(conn[0])
            except (ConnectionError, asyncio.IncompleteReadError) as e:
                conn[1].close()
                if reused and (not isinstance(e, asyncio.IncompleteReadError) or not e.partial):
                    continue
                raise
            except BaseException:  # cancelled or timed out: the replica sees the close and frees the work
                conn[1].close()
                raise
            if keep and len(self.idle) < IDLE_CONNECTIONS_MAX:
                self.idle.append(conn)
            else:
                conn[1].close()
            return resp
        raise AssertionError("unreachable: the second pass uses a fresh connection and returns or raises")

    def _head(self, method: bytes, path: str, body: bytes) -> bytes:
        target = path.encode()
        lines = [method + b" " + target + b" HTTP/1.1", b"host: " + self.host_header, b"content-type: application/json",
                 b"content-length: " + str(len(body)).encode()]
        if self.token is not None:
            lines.append(AUTH_HEADER.encode() + b": " + sign_request(self.token, method, target, body, time.time(),
                                                                      new_nonce()).encode())
        return b"\r\n".join(lines) + b"\r\n\r\n"

    def close(self) -> None:
        for _, w in self.idle:
            w.close()
        self.idle.clear()


async def _read_response(reader: asyncio.StreamReader) -> tuple[RawResponse, bool]:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError as e:
        raise ReplicaProtocolError("response head too large") from e
    if len(head) > HEAD_BYTES_MAX:
        raise ReplicaProtocolError("response head too large")
    lines = head[:-4].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ReplicaProtocolError(f"bad status line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise ReplicaProtocolError(f"bad header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    keep = headers.get("connection", "").lower() != "close" and parts[0] == "HTTP/1.1"
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = await _read_chunked(reader)
    elif "content-length" in headers:
        n = headers["content-length"]
        if not n.isdigit() or int(n) > BODY_BYTES_MAX:
            raise ReplicaProtocolError(f"bad content-length {n[:20]!r}")
        body = await reader.readexactly(int(n))
    else:
        body, keep = await reader.read(BODY_BYTES_MAX), False  # until the replica closes
    return RawResponse(int(parts[1]), headers, body), keep


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    out, total = [], 0
    for _ in range(1 << 20):  # bounded by the body limit below
        size_line = (await reader.readuntil(b"\r\n")).split(b";")[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError as e:
            raise ReplicaProtocolError(f"bad chunk size {size_line[:20]!r}") from e
        total += size
        if total > BODY_BYTES_MAX:
            raise ReplicaProtocolError("chunked body too large")
        if size == 0:
            await reader.readuntil(b"\r\n")  # no trailers from uvicorn
            return b"".join(out)
        out.append(await reader.readexactly(size))
        await reader.readexactly(2)
    raise ReplicaProtocolError("too many chunks")
