"""The event loop phalanx's own processes run on: uvloop's when it is installed (a pinned
dependency), asyncio's otherwise; ``PHALANX_EVENT_LOOP=asyncio`` forces asyncio's.

Why: a fault-free step crosses the control plane twice (the worker's hand-over to its control
thread, the report -> decision round trip through the coordinator), and on loopback those hops
are mostly event-loop and socket work in Python; uvloop's loop and transports are C. Protocol
code is plain asyncio either way (the simulator runs it on its own virtual-time loop).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from phalanx.core.errors import ConfigError

KINDS = ("auto", "uvloop", "asyncio")
T = TypeVar("T")


def loop_factory(kind: str | None = None) -> Callable[[], asyncio.AbstractEventLoop]:
    """``kind`` (default: $PHALANX_EVENT_LOOP, else auto): auto is uvloop when importable."""
    kind = kind if kind is not None else os.environ.get("PHALANX_EVENT_LOOP", "auto")
    if kind not in KINDS:
        raise ConfigError(f"PHALANX_EVENT_LOOP={kind!r}: use one of {', '.join(KINDS)}")
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError as e:
            if kind == "uvloop":
                raise ConfigError("PHALANX_EVENT_LOOP=uvloop but uvloop is not installed") from e
        else:
            return uvloop.new_event_loop  # type: ignore[no-any-return]
    return asyncio.new_event_loop


def new_event_loop() -> asyncio.AbstractEventLoop:
    return loop_factory()()


def run(main: Coroutine[Any, Any, T], kind: str | None = None) -> T:
    """``asyncio.run(main)`` on the loop ``loop_factory(kind)`` picks."""
    with asyncio.Runner(loop_factory=loop_factory(kind)) as runner:
        return runner.run(main)
