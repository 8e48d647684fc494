"""The Host seam: everything protocol code may use to touch the world.

Protocol logic (membership, quorum, step commit, healing) never reaches for the wall clock,
randomness, sockets, threads or process spawning directly. It receives a ``Host``. The real runtime
(:class:`phalanx.transport.real_host.RealHost`) and the simulator (:mod:`phalanx.sim`) provide one
each, so both run the same protocol code.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol, runtime_checkable

Buffers = Sequence[memoryview | bytes | bytearray]


@runtime_checkable
class Connection(Protocol):
    """One authenticated, ordered, message-framed connection to a peer."""

    peer: str

    async def send(self, message: Any, buffers: Buffers = ()) -> None:
        """Send one message (a msgspec Struct from core.messages) plus raw buffers."""

    def try_send(self, message: Any) -> bool:
        """Send one message now if that needs no waiting (nothing of this connection's still
        queued, no backpressure): True. Else False, and nothing was sent: ``send`` it instead.
        Raises ConnectionClosed as ``send`` would."""

    async def recv(self) -> tuple[Any, list[memoryview]]:
        """Receive the next message; raises ConnectionClosed when the peer is gone."""

    def close(self, reason: str = "closed") -> None:
        """Close the connection. Idempotent."""

    @property
    def is_closed(self) -> bool:
        """True once either side closed the connection."""


class Listener(Protocol):
    address: str

    def close(self) -> None: ...


class Transport(Protocol):
    """Control-plane transport seam (TcpTransport, SimTransport, FaultyTransport)."""

    async def connect(self, address: str, timeout_s: float) -> Connection: ...

    async def listen(
        self, address: str, on_connection: Callable[[Connection], Awaitable[None]]
    ) -> Listener: ...


class Host(Protocol):
    """Clock, seeded randomness, transport and task spawner for one node."""

    name: str
    rng: random.Random
    transport: Transport

    def now(self) -> float:
        """Seconds on this node's monotonic clock (virtual time in the simulator)."""

    async def sleep(self, seconds: float) -> None: ...

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> Any:
        """Start a background task owned by this node; returns an asyncio.Task-like handle."""

    async def run_blocking(self, fn: Callable[[], Any]) -> Any:
        """``fn()``, off the event loop where it could stall it (real runs: a worker thread, so a
        long copy or hash never silences the heartbeats); inline in the simulator (deterministic)."""

    def log(self, event: str, **fields: Any) -> None:
        """Record a structured event (goes to the run's events.jsonl / the sim trace)."""
