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
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

EVENT_LOOPS = ("auto", "asyncio")  # auto: uvloop + httptools when installed

T = TypeVar("T")


def has_fast_pair() -> bool:
    return importlib.util.find_spec("uvloop") is not None and importlib.util.find_spec("httptools") is not None


def loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop for ``kind``: uvloop's for auto when installed, else asyncio's default (None)."""
    assert kind in EVENT_LOOPS, kind
    if kind == "auto" and has_fast_pair():
        import uvloop

        return uvloop.new_event_loop
    return None


def http_impl(kind: str) -> str:
    """uvicorn's ``http`` setting matching ``loop_factory(kind)``."""
    return "httptools" if kind == "auto" and has_fast_pair() else "h11"


def describe(kind: str) -> str:
    return "uvloop + httptools" if http_impl(kind) == "httptools" else "asyncio + h11"


def run(main: Coroutine[Any, Any, T], kind: str = "auto", who: str = "phalanx serve") -> T:
    """``asyncio.run(main)`` on the event loop ``kind`` picks; says on stderr when auto falls back."""
    if kind == "auto" and not has_fast_pair():
        print(f"{who}: uvloop/httptools not installed: serving on asyncio + h11 (slower per request; "
              "`pip install uvloop httptools` or reinstall phalanx)", file=sys.stderr, flush=True)
    with asyncio.Runner(loop_factory=loop_factory(kind)) as runner:
        return runner.run(main)
