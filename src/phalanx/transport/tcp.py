"""TcpTransport: the real control-plane transport (asyncio TCP, HMAC-authenticated frames).

A frame that fails authentication, exceeds the size bound, is garbled or speaks another protocol
version closes that one connection with a logged reason. Nothing else changes.

Before a peer has authenticated it gets very little: handshake frames are capped at
``HANDSHAKE_MAX_FRAME_BYTES``, at most ``max_pending_handshakes`` handshakes run at once (more are
closed at once), the handshake and the first frame after it each have a deadline, a ClientHello
nonce seen before is refused (replay), and rejections are reported at most ``REJECT_REPORTS_PER_S``
per second, the rest counted and reported as one line. A flood of hostile connections costs
bounded memory and CPU and never delays an authenticated peer's heartbeats for long.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx.core import auth
from phalanx.core.codec import LEN, body_length, check_version, decode_body, encode_body
from phalanx.core.errors import AuthError, ConnectionClosed, FrameRejected, TransportError
from phalanx.core.messages import PROTOCOL_VERSION, ClientHello, Refused, ServerHello
from phalanx.transport.frames import FrameStream, StreamClosed

log = logging.getLogger("phalanx.transport")
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
HANDSHAKE_MAX_FRAME_BYTES = 4096  # a ClientHello is ~100 bytes: nothing bigger before authentication
MAX_PENDING_HANDSHAKES = 64
FIRST_FRAME_TIMEOUT_S = 10.0  # an accepted session must send its first (authenticated) frame by then
NONCES_REMEMBERED = 65_536  # ClientHello nonces kept to refuse replays
REJECT_REPORTS_PER_S = 10


@dataclass
class TransportStats:
    """Bytes and frames moved (the 'transport cost is zero' fallacy, counted)."""

    bytes_sent: int = 0
    frames_sent: int = 0
    bytes_received: int = 0
    frames_received: int = 0
    rejected: dict[str, int] = field(default_factory=dict)

    def note_rejected(self, kind: str) -> None:
        self.rejected[kind] = self.rejected.get(kind, 0) + 1


@dataclass(frozen=True)
class TlsFiles:
    """Optional TLS for the control plane and heal transfers between machines (mutual: every
    node presents a certificate signed by the cluster's CA and checks its peer's). It adds
    confidentiality; the cluster token's HMAC on every frame still authenticates the peer."""

    cert_file: str
    key_file: str
    ca_file: str

    @classmethod
    def from_env(cls, env: dict[str, str]) -> "TlsFiles | None":
        names = ("PHALANX_TLS_CERT", "PHALANX_TLS_KEY", "PHALANX_TLS_CA")
        given = [env.get(n, "") for n in names]
        if not any(given):
            return None
        if not all(given):
            missing = ", ".join(n for n, v in zip(names, given) if not v)
            raise TransportError(f"TLS needs a certificate, its key and the CA; {missing} not set")
        return cls(*given)

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        try:
            ctx = ssl.create_default_context(purpose, cafile=self.ca_file)
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as e:
            raise TransportError(f"cannot load TLS files (cert {self.cert_file}, key {self.key_file}, CA "
                                 f"{self.ca_file}): {e}") from e
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.verify_mode = ssl.CERT_REQUIRED  # both ways: a peer without a CA-signed certificate is refused
        ctx.check_hostname = False  # nodes are named by the cluster CA's signature, not by DNS
        return ctx

    def server_context(self) -> ssl.SSLContext:
        return self._context(ssl.Purpose.CLIENT_AUTH)

    def client_context(self) -> ssl.SSLContext:
        return self._context(ssl.Purpose.SERVER_AUTH)


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise TransportError(f"address {address!r} is not HOST:PORT")
    return host or "127.0.0.1", int(port)


class TcpConnection:
    """One authenticated connection: frames from a ``FrameStream`` (transport/frames.py), each
    verified against this direction's key and sequence number before it is decoded."""

    def __init__(self, stream: FrameStream, key: bytes, is_client: bool, peer: str, max_frame_bytes: int,
                 stats: TransportStats, first_frame_timeout_s: float | None = None) -> None:
        self._stream = stream
        stream.max_frame_bytes = max_frame_bytes  # authenticated from here: the full limit
        self._mac = auth.frame_mac_key(key)
        self._send_dir, self._recv_dir = (b"C", b"S") if is_client else (b"S", b"C")
        self._send_seq = 0
        self._recv_seq = 0
        self.peer = peer
        self._max = max_frame_bytes
        self.stats = stats
        self._closed = False
        self.close_reason = ""
        self._first_frame_timeout_s = first_frame_timeout_s  # server side: a replayed hello goes nowhere

    @property
    def is_closed(self) -> bool:
        return self._closed

    def extra(self, name: str) -> Any:
        """The socket's ``get_extra_info(name)`` (``socket``, ``peername``)."""
        return self._stream.extra(name)

    async def send(self, message: Any, buffers: Sequence[bytes | bytearray | memoryview] = ()) -> None:
        self._write(message, buffers)
        await self._stream.drain()  # returns at once unless the socket's buffer is above its mark

    def try_send(self, message: Any) -> bool:
        if self._stream.writing_paused and not self._closed:
            return False
        self._write(message, ())
        return True

    def _write(self, message: Any, buffers: Sequence[bytes | bytearray | memoryview]) -> None:
        if not self._closed and self._stream.is_closing():
            # the loop closed the transport itself (the peer reset it: a killed process) before any
            # recv saw it: uvloop would raise RuntimeError on the write, asyncio drop it unsaid
            self.close("peer reset the connection")
        if self._closed:
            raise ConnectionClosed(f"connection to {self.peer} is closed ({self.close_reason})")
        parts = encode_body(message, buffers)
        n = body_length(parts)
        if n > self._max:
            raise TransportError(f"refusing to send a {n}-byte frame; the limit is {self._max}")
        mac = auth.frame_mac_with(self._mac, self._send_dir, self._send_seq, parts)
        self._send_seq += 1
        self._stream.write([LEN.pack(n), mac, *parts])  # one frame, never interleaved
        self.stats.bytes_sent += n + LEN.size + auth.MAC_BYTES
        self.stats.frames_sent += 1

    async def recv(self) -> tuple[Any, list[memoryview]]:
        try:
            if self._recv_seq == 0 and self._first_frame_timeout_s is not None:
                async with asyncio.timeout(self._first_frame_timeout_s):
                    mac, body = await self._stream.next_frame()
            else:
                mac, body = await self._stream.next_frame()
        except asyncio.TimeoutError as e:
            self._reject(f"no frame within {self._first_frame_timeout_s:g} s of the handshake", "first_frame")
            raise ConnectionClosed(f"{self.peer} sent nothing after its handshake") from e
        except FrameRejected as e:
            self._reject(str(e), "oversized" if "limit" in str(e) else "garbled")
            raise
        except StreamClosed as e:
            self.close("peer closed the connection")
            raise ConnectionClosed(f"connection to {self.peer} closed") from e
        expected = auth.frame_mac_with(self._mac, self._recv_dir, self._recv_seq, [body])
        if not auth.macs_equal(mac, expected):
            self._reject("frame failed HMAC verification (wrong token, replay or corruption)", "auth")
            raise AuthError(f"frame from {self.peer} failed HMAC verification")
        self._recv_seq += 1
        self.stats.bytes_received += len(body) + LEN.size + auth.MAC_BYTES
        self.stats.frames_received += 1
        try:
            return decode_body(memoryview(body))
        except FrameRejected as e:
            self._reject(str(e), "garbled")
            raise

    def _reject(self, reason: str, kind: str) -> None:
        log.warning("closing connection with %s: %s", self.peer, reason)
        self.stats.note_rejected(kind)
        self.close(reason)

    def close(self, reason: str = "closed") -> None:
        if self._closed:
            return
        self._closed = True
        self.close_reason = reason
        try:
            self._stream.close()
        except RuntimeError:  # loop already closed
            pass


async def read_frame(stream: FrameStream) -> tuple[bytes, bytes]:
    """One handshake frame (the stream's limit is the pre-authentication one until then)."""
    try:
        return await stream.next_frame()
    except StreamClosed as e:
        raise ConnectionClosed("peer closed the connection during the handshake") from e


class TcpListener:
    def __init__(self, server: asyncio.Server, address: str) -> None:
        self._server = server
        self.address = address

    def close(self) -> None:
        self._server.close()


class TcpTransport:
    """Real TCP transport. One per process; all connections share its token and stats."""

    def __init__(self, token: bytes, name: str = "node", max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 handshake_timeout_s: float = 5.0,
                 on_reject: Callable[[str, str], None] | None = None, tls: TlsFiles | None = None) -> None:
        self._token = token
        self.name = name
        self.max_frame_bytes = max_frame_bytes
        self.handshake_timeout_s = handshake_timeout_s
        self.stats = TransportStats()
        self._on_reject = on_reject
        self._server_tls = tls.server_context() if tls else None
        self._client_tls = tls.client_context() if tls else None
        self.max_pending_handshakes = MAX_PENDING_HANDSHAKES
        self.first_frame_timeout_s = FIRST_FRAME_TIMEOUT_S
        self._pending = 0
        self._nonces: OrderedDict[bytes, None] = OrderedDict()
        self._reports_window_s = 0.0
        self._reports_in_window = 0
        self._suppressed = 0

    def _report_reject(self, peer: str, why: str) -> None:
        """Tell the owner (an event in the run's log) about a refused peer, rate-limited: at most
        REJECT_REPORTS_PER_S a second, then one line with how many more were refused."""
        if self._on_reject is None:
            return
        now = time.monotonic()
        if now - self._reports_window_s >= 1.0:
            if self._suppressed:
                self._on_reject("*", f"{self._suppressed} more connections refused in the last second "
                                     "(reports are rate-limited)")
            self._reports_window_s, self._reports_in_window, self._suppressed = now, 0, 0
        if self._reports_in_window < REJECT_REPORTS_PER_S:
            self._reports_in_window += 1
            self._on_reject(peer, why)
        else:
            self._suppressed += 1

    def _is_replay(self, nonce: bytes) -> bool:
        if nonce in self._nonces:
            return True
        self._nonces[nonce] = None
        if len(self._nonces) > NONCES_REMEMBERED:
            self._nonces.popitem(last=False)
        return False

    async def connect(self, address: str, timeout_s: float) -> TcpConnection:
        host, port = split_address(address)
        loop = asyncio.get_running_loop()
        try:
            _, stream = await asyncio.wait_for(
                loop.create_connection(lambda: FrameStream(HANDSHAKE_MAX_FRAME_BYTES), host, port,
                                       ssl=self._client_tls), timeout_s)
        except (OSError, asyncio.TimeoutError) as e:  # ssl.SSLError is an OSError
            raise TransportError(f"cannot connect to {address}: {e or 'timed out'}") from e
        _nodelay(stream)
        try:
            return await asyncio.wait_for(self._client_handshake(stream, address), self.handshake_timeout_s)
        except asyncio.TimeoutError as e:
            stream.close()
            raise TransportError(f"handshake with {address} timed out") from e
        except ConnectionClosed as e:
            stream.close()
            raise TransportError(f"{address} closed the connection during the handshake") from e
        except BaseException:
            stream.close()
            raise

    async def _client_handshake(self, stream: FrameStream, address: str) -> TcpConnection:
        nonce = auth.new_nonce()
        await _send_handshake(stream, self._token, ClientHello(protocol_version=PROTOCOL_VERSION, nonce=nonce,
                                                               client=self.name))
        mac, body = await read_frame(stream)
        if not auth.macs_equal(mac, auth.handshake_mac(self._token, body)):
            raise AuthError(f"{address} failed authentication (different cluster token?)")
        reply, _ = decode_body(memoryview(body))
        if isinstance(reply, Refused):
            raise TransportError(f"{address} refused the connection: {reply.reason}")
        if not isinstance(reply, ServerHello):
            raise FrameRejected(f"{address} answered the handshake with {type(reply).__name__}")
        check_version(reply.protocol_version, PROTOCOL_VERSION)
        key = auth.session_key(self._token, nonce, reply.nonce)
        return TcpConnection(stream, key, True, address, self.max_frame_bytes, self.stats)

    async def listen(self, address: str, on_connection: Callable[[TcpConnection], Awaitable[None]]) -> TcpListener:
        host, port = split_address(address)
        loop = asyncio.get_running_loop()
        handlers: set[asyncio.Task[None]] = set()  # each accepted connection's task, kept until it ends

        async def handle(stream: FrameStream) -> None:
            peername = stream.extra("peername")
            peer = f"{peername[0]}:{peername[1]}" if peername else "?"
            if self._pending >= self.max_pending_handshakes:
                self.stats.note_rejected("busy")
                self._report_reject(peer, f"{self._pending} handshakes already in progress")
                stream.close()
                return
            _nodelay(stream)
            self._pending += 1
            try:
                conn = await asyncio.wait_for(self._server_handshake(stream, peer), self.handshake_timeout_s)
            except (TransportError, asyncio.TimeoutError) as e:
                reason = str(e) or "handshake timed out"
                log.debug("refused connection from %s: %s", peer, reason)
                self.stats.note_rejected("handshake")
                self._report_reject(peer, reason)
                stream.close()
                return
            except BaseException:
                stream.close()  # cancelled mid-handshake (the listener's loop is ending): never leave it open
                raise
            finally:
                self._pending -= 1
            try:
                await on_connection(conn)
            finally:
                if conn.close_reason and conn.close_reason not in ("closed", "peer closed the connection"):
                    self._report_reject(peer, conn.close_reason)
                conn.close()

        def accepted(stream: FrameStream) -> None:
            task = loop.create_task(handle(stream))
            handlers.add(task)
            task.add_done_callback(handlers.discard)

        server = await loop.create_server(lambda: FrameStream(HANDSHAKE_MAX_FRAME_BYTES, accepted), host, port,
                                          ssl=self._server_tls,
                                          ssl_handshake_timeout=self.handshake_timeout_s if self._server_tls else None)
        bound = server.sockets[0].getsockname()
        return TcpListener(server, f"{bound[0]}:{bound[1]}")

    async def _server_handshake(self, stream: FrameStream, peer: str) -> TcpConnection:
        mac, body = await read_frame(stream)
        if not auth.macs_equal(mac, auth.handshake_mac(self._token, body)):
            raise AuthError("handshake frame failed HMAC verification (wrong cluster token)")
        hello, _ = decode_body(memoryview(body))
        if not isinstance(hello, ClientHello):
            raise FrameRejected(f"first frame was {type(hello).__name__}, expected ClientHello")
        if self._is_replay(bytes(hello.nonce)):
            raise AuthError("replayed ClientHello (its nonce was used before)")
        try:
            check_version(hello.protocol_version, PROTOCOL_VERSION)
        except TransportError as e:
            await _send_handshake(stream, self._token, Refused(reason=str(e)))
            raise
        nonce = auth.new_nonce()
        await _send_handshake(stream, self._token, ServerHello(protocol_version=PROTOCOL_VERSION, nonce=nonce))
        key = auth.session_key(self._token, hello.nonce, nonce)
        return TcpConnection(stream, key, False, f"{hello.client}@{peer}", self.max_frame_bytes, self.stats,
                             self.first_frame_timeout_s)


async def _send_handshake(stream: FrameStream, token: bytes, message: Any) -> None:
    parts = encode_body(message)
    body = b"".join(bytes(p) for p in parts)
    stream.write([LEN.pack(len(body)) + auth.handshake_mac(token, body) + body])
    await stream.drain()


def _nodelay(stream: FrameStream) -> None:
    sock = stream.extra("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
