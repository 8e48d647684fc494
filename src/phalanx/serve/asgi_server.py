"""How the serving processes (replica, router) run uvicorn: uvloop's event loop and httptools' HTTP
parser when they are installed, plain asyncio and h11 otherwise.

Why: every request through the router crosses two HTTP hops on loopback, and at ~1 ms of added
latency per request the event loop's and the parser's own Python costs are what is left to cut
(docs/SERVING.md, "Speed (session 12)"). Both are pinned dependencies; a process that lacks them
still serves, says so once on stderr, and behaves the same. ``--event-loop asyncio`` forces the
plain pair (to compare, or to rule the fast pair out when something looks wrong).
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

from phalanx.core import event_loop

EVENT_LOOPS = ("auto", "asyncio")  # auto: uvloop + httptools when installed

T = TypeVar("T")


def has_fast_pair() -> bool:
    return importlib.util.find_spec("uvloop") is not None and importlib.util.find_spec("httptools") is not None


def http_impl(kind: str) -> str | type[asyncio.Protocol]:
    """uvicorn's ``http`` setting matching the loop ``run(kind)`` picks: httptools with one send per response
    (``coalescing_httptools``) for auto when installed, else h11."""
    return coalescing_httptools() if kind == "auto" and has_fast_pair() else "h11"


def describe(kind: str) -> str:
    return "asyncio + h11" if http_impl(kind) == "h11" else "uvloop + httptools"


WRITE_COALESCE_BYTES_MAX = 64 * 1024  # past this, buffered writes go out at once (flow control sees them)


class CoalescingTransport:
    """The writes a connection makes in one event-loop iteration leave in one ``send``.

    uvicorn writes a response's head and its body separately: on loopback each write is a syscall that also
    delivers the data and wakes the reader, so a small answer cost two sends here and two wake-ups (and
    reads) at the router or client. Buffered writes go out at the end of the current iteration (``call_soon``),
    before ``close``, or at once past ``WRITE_COALESCE_BYTES_MAX``; order is kept and nothing is held longer
    than the iteration that wrote it. Everything else is the real transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._pending: list[bytes] = []
        self._pending_bytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))
        self._pending_bytes += len(data)
        if self._pending_bytes > WRITE_COALESCE_BYTES_MAX:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending) if len(self._pending) > 1 else self._pending[0]
            self._pending.clear()
            self._pending_bytes = 0
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._pending.clear()
        self._pending_bytes = 0
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + self._pending_bytes

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, ...
        return getattr(self._transport, name)


def coalescing_httptools() -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol on a ``CoalescingTransport`` (imported only when httptools is installed)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class CoalescingHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]

        def on_response_complete(self) -> None:
            # the whole answer is written: it leaves now, not after the rest of this loop iteration (the
            # handler's own cleanup, other ready callbacks, a poll); a stream's chunks still coalesce per iteration
            self.transport.flush()  # type: ignore[attr-defined]
            super().on_response_complete()

    return CoalescingHttpToolsProtocol


def run(main: Coroutine[Any, Any, T], kind: str = "auto", who: str = "phalanx serve") -> T:
    """``asyncio.run(main)`` on the event loop ``kind`` picks; says on stderr when auto falls back."""
    if kind == "auto" and not has_fast_pair():
        print(f"{who}: uvloop/httptools not installed: serving on asyncio + h11 (slower per request; "
              "`pip install uvloop httptools` or reinstall phalanx)", file=sys.stderr, flush=True)
    assert kind in EVENT_LOOPS, kind
    # uvloop only with httptools (the pair or neither): core/event_loop.py picks and builds the loop
    return event_loop.run(main, "uvloop" if kind == "auto" and has_fast_pair() else "asyncio")
