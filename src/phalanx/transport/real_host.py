"""RealHost: the Host seam on the real machine (monotonic clock, OS randomness seed, TCP)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any

from phalanx.core.host import Transport

log = logging.getLogger("phalanx")


class RealHost:
    def __init__(self, name: str, transport: Transport, seed: int | None = None,
                 on_log: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.name = name
        self.transport = transport
        self.rng = random.Random(seed)
        self._tasks: set[asyncio.Task[Any]] = set()  # strong refs: asyncio keeps only weak ones
        self._on_log = on_log

    # time.monotonic, not loop.time(): uvloop's clock is libuv's, in whole milliseconds and read
    # once per loop iteration, which rounded every step time the coordinator records to the ms
    # (nothing here schedules with call_at, so the two clocks never meet in a deadline)
    now = staticmethod(time.monotonic)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.name}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._reap)
        return task

    async def run_blocking(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.to_thread(fn)

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed: %r", task.get_name(), task.exception(), exc_info=task.exception())

    def log(self, event: str, **fields: Any) -> None:
        if self._on_log:
            self._on_log(event, fields)
