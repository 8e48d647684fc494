"""An alarm clock on the Host seam: a task sleeps until a due time that others may bring forward.

The coordinator's ticker used to wake every 20 ms whatever the cluster did: 50 wakeups a second,
each a detection pass and a commit check, ~13 ms of the launcher's CPU a second while every worker
was simply computing. With an alarm it sleeps until the earliest moment something can be due (a
heartbeat silence, the progress watch, a formation's wait), and whatever makes something due
sooner (a worker asking for a quorum, a shorter deadline) brings the alarm forward with
:meth:`Alarm.ring_by`. Plain asyncio futures and ``call_later``: the real loop (uvloop's or
asyncio's) and the simulator's virtual-time loop run it alike.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from phalanx.core.host import Host

_TIMER, _RUNG = "timer", "rung"


class Alarm:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.due_s = math.inf  # when the sleeper should run next (inf: nothing due)
        self._waiter: asyncio.Future[str] | None = None

    def ring_by(self, at_s: float) -> None:
        """Make the sleeper run no later than ``at_s`` (an earlier due time than this is kept)."""
        if at_s < self.due_s:
            self.due_s = at_s
            w = self._waiter
            if w is not None and not w.done():
                w.set_result(_RUNG)  # it sleeps again toward the new, earlier due time

    def clear(self) -> None:
        """Nothing is due: the sleeper's next round brings the due time forward from infinity."""
        self.due_s = math.inf

    async def wait(self) -> float:
        """Sleep until the due time; returns that due time (how late the caller runs is now minus
        it). A due time already past returns at once; an infinite one waits for a ring."""
        loop = asyncio.get_running_loop()
        while True:
            due = self.due_s
            delay = due - self.host.now()
            if delay <= 0:
                break
            w = self._waiter = loop.create_future()
            timer = loop.call_later(delay, _ring, w) if delay < math.inf else None
            try:
                why = await w
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
            if why == _TIMER and self.due_s == due:
                break  # on time (a loop with whole-millisecond timers may fire up to 1 ms early)
        await self.host.sleep(0)  # the simulator: a frozen node runs only once it is thawed
        return due


def _ring(w: "asyncio.Future[Any]") -> None:
    if not w.done():
        w.set_result(_TIMER)
