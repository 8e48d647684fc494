"""SimHost: the Host seam on a simulated node (virtual clock, seeded rng, SimTransport)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Coroutine
from typing import Any

from phalanx.sim.connection import SimTransport
from phalanx.sim.network import SimNetwork, SimNode


class SimHost:
    def __init__(self, net: SimNetwork, node: SimNode, seed: int,
                 on_log: Callable[[str, str, dict[str, Any]], None] | None = None) -> None:
        self.name = node.name
        self.net, self.node = net, node
        self.rng = random.Random(f"host:{seed}:{node.name}:{node.incarnation}")
        self.transport = SimTransport(net, node)
        self._on_log = on_log
        self._loop: asyncio.AbstractEventLoop | None = None

    def now(self) -> float:
        """The virtual clock. The first call, on the simulation's loop (a host is made before or on
        it), puts the loop's own ``time`` in this method's place: no extra frame per reading."""
        loop = self._loop = asyncio.get_running_loop()
        self.now = loop.time  # type: ignore[method-assign]
        return loop.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        # a frozen (SIGSTOPped) node does not wake until it is thawed
        while self.node.frozen_until_s > self.now():
            await asyncio.sleep(self.node.frozen_until_s - self.now())

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        return self.net.spawn(self.node, coro, name)

    async def run_blocking(self, fn: Callable[[], Any]) -> Any:
        return fn()  # virtual time: no thread, the same result at the same instant every run

    def log(self, event: str, **fields: Any) -> None:
        if self._on_log:
            self._on_log(self.name, event, fields)
