"""The router's unary calls to a replica: signed HTTP/1.1 over a small pool of keep-alive connections.

Why not httpx here: its connection pool checks every pooled connection (``has_expired``, a socket
poll and ``getpeername`` each) on every request, which was half of the router's 5 ms of CPU per
request at 200 req/s. A replica is one host; requests are small JSON bodies with a Content-Length
answer; so a list of idle connections per replica, reused last-in first-out, is all it takes.
Health polls use it too (10 a second per replica: through httpx they cost as much as 25 requests).
Streams keep using httpx (its cost is spread over a whole generation).

Each connection is an ``asyncio.Protocol`` that parses the answer as its bytes arrive and wakes the waiting
request once, with the whole response (session 14: asyncio's StreamReader woke it per ``readuntil`` /
``readexactly``, and ``asyncio.timeout`` added a context manager and a reschedule per request).
One write per request (head and body together); one timer per request for its deadline.

A connection is returned to the pool only after a complete response; a cancelled request (a hedge
that lost, a replica voted out) closes its connection, which the replica sees as a disconnect and
cancels the generation. ``abandon`` (a question asked every ``ABANDON_CHECK_S`` while the answer is
awaited) lets the caller give a request up the same way without a task of its own to cancel.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from phalanx.core.auth import new_nonce
from phalanx.serve.request_auth import AUTH_HEADER, sign_request

IDLE_CONNECTIONS_MAX = 64  # per replica; more concurrent requests open more, closed after use
HEAD_BYTES_MAX = 64 * 1024
BODY_BYTES_MAX = 16 << 20
CHUNKS_MAX = 1 << 20
ABANDON_CHECK_S = 0.05  # how often a waiting request asks ``abandon`` (as the router's hedge loop polls)


class ReplicaProtocolError(ConnectionError):
    """The replica's answer was not valid HTTP/1.1 (or too large): treated like a dropped connection."""


class Abandoned(Exception):
    """The caller's ``abandon`` said yes while the answer was awaited: the connection was closed (the replica
    sees a disconnect and frees the work). Not an error of the replica's."""


@dataclass(frozen=True)
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes


class _Head:
    """A parsed status line and headers, and how the body is framed."""

    __slots__ = ("status", "headers", "keep", "length", "chunked")

    def __init__(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ReplicaProtocolError(f"bad status line {lines[0][:80]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ReplicaProtocolError(f"bad header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        self.status, self.headers = int(parts[1]), headers
        self.keep = headers.get("connection", "").lower() != "close" and parts[0] == "HTTP/1.1"
        self.chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        self.length: int | None = None  # None and not chunked: the body runs until the replica closes
        if not self.chunked and "content-length" in headers:
            n = headers["content-length"]
            if not n.isdigit() or int(n) > BODY_BYTES_MAX:
                raise ReplicaProtocolError(f"bad content-length {n[:20]!r}")
            self.length = int(n)
        elif not self.chunked:
            self.keep = False


class ReplicaConnection(asyncio.Protocol):
    """One keep-alive connection to a replica; one request at a time (``exchange``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.head: _Head | None = None
        self.chunks: list[bytes] = []
        self.chunks_bytes = 0
        self.received_bytes = 0  # of the answer now awaited
        self.waiter: asyncio.Future[RawResponse] | None = None
        self.closed = False
        self.keep = False
        self._watch: asyncio.TimerHandle | None = None

    # --- protocol callbacks --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport: a Transport, not by isinstance

    def data_received(self, data: bytes) -> None:
        waiter = self.waiter
        if waiter is None or waiter.done():  # bytes nobody asked for: this connection cannot be trusted again
            self.close()
            return
        self.buf += data
        self.received_bytes += len(data)
        try:
            resp = self._parse()
        except ReplicaProtocolError as e:
            waiter.set_exception(e)
            return
        if resp is not None:
            waiter.set_result(resp)

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        head = self.head
        if head is not None and head.length is None and not head.chunked:  # the body ran until the close
            waiter.set_result(RawResponse(head.status, head.headers, bytes(self.buf)))
            return
        if isinstance(exc, ConnectionError) and not self.received_bytes:
            waiter.set_exception(exc)  # e.g. reset before any answer: a connection the replica had closed
        else:  # partial: what arrived of this answer (empty only when nothing did: then the request may go again)
            partial = b"" if not self.received_bytes else bytes(self.buf) or b"\r\n\r\n"  # (the head was consumed)
            waiter.set_exception(asyncio.IncompleteReadError(partial, None))

    # --- one request ---------------------------------------------------------------------------
    async def exchange(self, data: bytes, timeout_s: float, abandon: Callable[[], bool] | None) -> RawResponse:
        """Send one request (one write) and wait for its whole answer. Raises asyncio.IncompleteReadError or
        ConnectionError (dropped), ReplicaProtocolError, TimeoutError, Abandoned."""
        if self.closed or self.transport is None or self.transport.is_closing():
            raise asyncio.IncompleteReadError(b"", None)  # closed while idle: the caller retries on a fresh one
        assert self.waiter is None, "one request at a time per connection"
        self.buf.clear()
        self.head, self.chunks, self.chunks_bytes, self.received_bytes = None, [], 0, 0
        waiter: asyncio.Future[RawResponse] = self.loop.create_future()
        self.waiter = waiter
        deadline = self.loop.call_later(timeout_s, _fail, waiter, TimeoutError)
        if abandon is not None:
            self._watch = self.loop.call_later(ABANDON_CHECK_S, self._check_abandon, abandon)
        try:
            self.transport.write(data)
            resp = await waiter
        finally:
            deadline.cancel()
            if self._watch is not None:
                self._watch.cancel()
                self._watch = None
            self.waiter = None
        self.keep = self.head is not None and self.head.keep and not self.buf  # nothing unasked-for pending
        return resp

    def _check_abandon(self, abandon: Callable[[], bool]) -> None:
        if self.waiter is None or self.waiter.done():
            return
        if abandon():
            self.waiter.set_exception(Abandoned())
        else:
            self._watch = self.loop.call_later(ABANDON_CHECK_S, self._check_abandon, abandon)

    def _parse(self) -> RawResponse | None:
        """The whole response once it is in ``buf`` (consumed), else None. Raises ReplicaProtocolError."""
        if self.head is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > HEAD_BYTES_MAX:
                    raise ReplicaProtocolError("response head too large")
                return None
            if end > HEAD_BYTES_MAX:
                raise ReplicaProtocolError("response head too large")
            self.head = _Head(bytes(self.buf[:end]))
            del self.buf[:end + 4]
        head = self.head
        if head.chunked:
            return self._parse_chunks(head)
        if head.length is None:
            if len(self.buf) > BODY_BYTES_MAX:
                raise ReplicaProtocolError("body too large")
            return None  # until the replica closes (connection_lost completes it)
        if len(self.buf) < head.length:
            return None
        body = bytes(self.buf[:head.length])
        del self.buf[:head.length]
        return RawResponse(head.status, head.headers, body)

    def _parse_chunks(self, head: _Head) -> RawResponse | None:
        for _ in range(CHUNKS_MAX):  # bounded by the body limit below
            eol = self.buf.find(b"\r\n")
            if eol < 0:
                if len(self.buf) > 1024:
                    raise ReplicaProtocolError("bad chunk size line")
                return None
            size_line = bytes(self.buf[:eol]).split(b";")[0].strip()
            try:
                size = int(size_line, 16)
            except ValueError as e:
                raise ReplicaProtocolError(f"bad chunk size {size_line[:20]!r}") from e
            if size == 0:  # no trailers from uvicorn: the last chunk is "0\r\n\r\n"
                if len(self.buf) < eol + 4:
                    return None
                del self.buf[:eol + 4]
                return RawResponse(head.status, head.headers, b"".join(self.chunks))
            if self.chunks_bytes + size > BODY_BYTES_MAX:
                raise ReplicaProtocolError("chunked body too large")
            if len(self.buf) < eol + 2 + size + 2:
                return None
            self.chunks.append(bytes(self.buf[eol + 2:eol + 2 + size]))
            self.chunks_bytes += size
            del self.buf[:eol + 2 + size + 2]
        raise ReplicaProtocolError("too many chunks")

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _fail(waiter: asyncio.Future[RawResponse], exc: type[BaseException]) -> None:
    if not waiter.done():
        waiter.set_exception(exc())


class ReplicaConnections:
    def __init__(self, url: str, token: bytes | None) -> None:
        assert url.startswith("http://"), url
        hostport = url.removeprefix("http://").rstrip("/")
        host, _, port = hostport.rpartition(":")
        self.host, self.port, self.token = host, int(port), token
        self.host_header = hostport.encode()
        self.idle: list[ReplicaConnection] = []

    async def post(self, path: str, body: bytes, timeout_s: float, connect_timeout_s: float = 0.5,
                   abandon: Callable[[], bool] | None = None) -> RawResponse:
        return await self.request(b"POST", path, body, timeout_s, connect_timeout_s, abandon)

    async def get(self, path: str, timeout_s: float) -> RawResponse:
        return await self.request(b"GET", path, b"", timeout_s, timeout_s)

    async def request(self, method: bytes, path: str, body: bytes, timeout_s: float, connect_timeout_s: float,
                      abandon: Callable[[], bool] | None = None) -> RawResponse:
        """One request. Raises ConnectionRefusedError (nothing listens: the replica is gone), ConnectionError or
        asyncio.IncompleteReadError (dropped mid-request), TimeoutError, ReplicaProtocolError, Abandoned."""
        data = self._head(method, path, body) + body
        for reused in (True, False):  # a pooled connection the replica closed while idle: once more on a fresh one
            conn = self._pop_idle() if reused else None
            if conn is None:
                reused = False
                conn = await self._connect(connect_timeout_s)
            try:
                resp = await conn.exchange(data, timeout_s, abandon)
            except (ConnectionError, asyncio.IncompleteReadError) as e:
                conn.close()
                if reused and (not isinstance(e, asyncio.IncompleteReadError) or not e.partial):
                    continue
                raise
            except BaseException:  # cancelled, timed out or abandoned: the replica sees the close and frees the work
                conn.close()
                raise
            if conn.keep and not conn.closed and len(self.idle) < IDLE_CONNECTIONS_MAX:
                self.idle.append(conn)
            else:
                conn.close()
            return resp
        raise AssertionError("unreachable: the second pass uses a fresh connection and returns or raises")

    def _pop_idle(self) -> ReplicaConnection | None:
        while self.idle:  # bounded by the pool
            conn = self.idle.pop()
            if not conn.closed:
                return conn
        return None

    async def _connect(self, timeout_s: float) -> ReplicaConnection:
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(loop.create_connection(lambda: ReplicaConnection(loop), self.host, self.port),
                                         timeout_s)
        return conn

    def _head(self, method: bytes, path: str, body: bytes) -> bytes:
        target = path.encode()
        head = (method + b" " + target + b" HTTP/1.1\r\nhost: " + self.host_header +
                b"\r\ncontent-type: application/json\r\ncontent-length: " + str(len(body)).encode())
        if self.token is not None:
            head += b"\r\n" + AUTH_HEADER.encode() + b": " + sign_request(self.token, method, target, body, time.time(),
                                                                          new_nonce()).encode()
        return head + b"\r\n\r\n"

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()
