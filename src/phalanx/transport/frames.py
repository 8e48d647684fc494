"""Frames ``[length | MAC | body]`` cut from a TCP stream as its bytes arrive.

``FrameStream`` is the asyncio protocol under every ``TcpConnection``: ``data_received`` cuts
whole frames out of what arrived and queues them, and ``next_frame`` hands them out in order. It
replaces ``asyncio.StreamReader``, whose two ``readexactly`` calls a frame (each a coroutine, a
future when the bytes were not there yet, and a copy out of its buffer) cost more than the
frame's HMAC and decoding together: on this project's 2-core box a round trip of one report and
its decision between two processes took 0.25-0.34 ms of CPU a side through the streams, 0.19-0.28
through this (docs/BENCHMARKS.md, session 32). Nothing is verified or decoded here; the
connection does that with the frame in hand.

Limits hold as the bytes arrive: a length above ``max_frame_bytes`` is refused before any of its
body is kept (the pre-authentication cap is the same check with a smaller limit), and reading
pauses while more than ``QUEUED_BYTES_MAX`` of whole frames wait unread, so a peer that floods a
connection nobody reads costs bounded memory.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from phalanx.core import auth
from phalanx.core.codec import LEN
from phalanx.core.errors import FrameRejected

HEAD = LEN.size + auth.MAC_BYTES
QUEUED_BYTES_MAX = 1 << 20  # whole frames waiting unread before reading pauses


class StreamClosed(Exception):
    """The peer closed the stream (or it was reset); ``partial`` if it ended inside a frame."""


class FrameStream(asyncio.Protocol):
    """One TCP stream's frames (see the module). Writes go straight to the transport; a writer
    waits in ``drain`` only while the transport's buffer is above its high-water mark."""

    def __init__(self, max_frame_bytes: int, on_connect: Any = None) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.transport: asyncio.Transport | None = None
        self._on_connect = on_connect  # server side: starts the connection's handler
        self._buf = bytearray()
        self._frames: deque[tuple[bytes, bytes]] = deque()
        self._queued = 0
        self._error: Exception | None = None  # after the queued frames: FrameRejected or StreamClosed
        self._waiter: asyncio.Future[None] | None = None
        self._paused_reading = False
        self._paused_writing = False
        self._drained: asyncio.Future[None] | None = None
        self._lost = False

    # ---- asyncio.Protocol ----
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        if self._on_connect is not None:
            self._on_connect(self)

    def data_received(self, data: bytes) -> None:
        if self._error is not None:
            return
        buf = self._buf
        if not buf and len(data) >= HEAD:  # the common case: one whole frame in one read, no copy
            (n,) = LEN.unpack_from(data, 0)
            if len(data) == HEAD + n and n <= self.max_frame_bytes:
                self._queue(data[LEN.size:HEAD], data[HEAD:])
                return
        buf += data
        while len(buf) >= HEAD:
            (n,) = LEN.unpack_from(buf, 0)
            if n > self.max_frame_bytes:
                self._fail(FrameRejected(f"frame of {n} bytes exceeds the limit of {self.max_frame_bytes}"))
                return
            if len(buf) < HEAD + n:
                break
            self._queue(bytes(buf[LEN.size:HEAD]), bytes(buf[HEAD:HEAD + n]), wake=False)
            del buf[:HEAD + n]
        self._wake()

    def eof_received(self) -> bool:
        self._fail(StreamClosed("partial" if self._buf else ""))
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._fail(StreamClosed("partial" if self._buf else ""))
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)  # the writer sees the closed transport on its next send

    def pause_writing(self) -> None:
        self._paused_writing = True

    def resume_writing(self) -> None:
        self._paused_writing = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # ---- the connection's side ----
    async def next_frame(self) -> tuple[bytes, bytes]:
        """The next whole frame (MAC, body); raises FrameRejected or StreamClosed once the frames
        before the problem are taken."""
        while not self._frames:
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        mac, body = self._frames.popleft()
        self._queued -= len(body)
        if self._paused_reading and self._queued <= QUEUED_BYTES_MAX // 2 and self.transport is not None:
            self._paused_reading = False
            self.transport.resume_reading()
        return mac, body

    def write(self, parts: list[Any]) -> None:
        assert self.transport is not None
        self.transport.writelines(parts)

    async def drain(self) -> None:
        if self._paused_writing and not self._lost:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    @property
    def writing_paused(self) -> bool:
        return self._paused_writing and not self._lost

    def is_closing(self) -> bool:
        return self._lost or self.transport is None or self.transport.is_closing()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def extra(self, name: str) -> Any:
        return self.transport.get_extra_info(name) if self.transport is not None else None

    # ---- internals ----
    def _queue(self, mac: bytes, body: bytes, wake: bool = True) -> None:
        self._frames.append((mac, body))
        self._queued += len(body)
        if self._queued > QUEUED_BYTES_MAX and not self._paused_reading and self.transport is not None:
            self._paused_reading = True
            self.transport.pause_reading()
        if wake:
            self._wake()

    def _fail(self, error: Exception) -> None:
        if self._error is None:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
