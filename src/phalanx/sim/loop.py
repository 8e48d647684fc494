"""A virtual-time asyncio event loop: the simulator's clock.

Production protocol code is plain asyncio (futures, queues, ``wait_for``, ``sleep``), so the
simulator runs it unchanged on this loop. When nothing is runnable the loop jumps straight to the
next timer: no fixed tick, no idle cycles, no real I/O. Timers due at the same instant run in an
order drawn from the seeded RNG, which shakes out ordering assumptions while staying replayable.
"""

from __future__ import annotations

import asyncio
import heapq
import random
from collections.abc import Coroutine
from typing import Any


class SimDeadlock(RuntimeError):
    """Nothing is runnable and no timer is pending, but the awaited work has not finished."""


class _VirtualSelector:
    """Stands in for the OS selector: 'waiting' advances virtual time instead of blocking."""

    def __init__(self, loop: "VirtualTimeLoop") -> None:
        self._loop = loop

    def select(self, timeout: float | None) -> list[Any]:
        self._loop._advance(timeout)
        return []

    def close(self) -> None:
        return None

    def get_map(self) -> dict[Any, Any]:
        return {}


class VirtualTimeLoop(asyncio.BaseEventLoop):  # type: ignore[misc]
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self._vt = 0.0
        self.rng = random.Random(f"loop:{seed}")
        self._selector = _VirtualSelector(self)
        self._clock_resolution = 1e-9
        self.timer_events = 0  # timers fired: the simulator's unit of work
        self.errors: list[str] = []  # unhandled task errors (other than cancellation at teardown)
        self.set_exception_handler(self._on_error)

    def _on_error(self, loop: Any, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, asyncio.CancelledError):
            return
        if len(self.errors) < 20:
            self.errors.append(f"{context.get('message', '')}: {exc!r}")

    def time(self) -> float:
        return self._vt

    def _advance(self, timeout: float | None) -> None:
        """Jump to the next due timer and move every timer due then into the ready queue, shuffled."""
        if timeout is None:
            raise SimDeadlock(f"deadlock at virtual t={self._vt:.6f} s: no runnable task and no pending timer")
        sched = self._scheduled
        if timeout > 0:
            # land exactly on the next timer (vt + (when - vt) can round just short of it)
            new = sched[0]._when if sched and sched[0]._when <= self._vt + timeout + 1e-9 else self._vt + timeout
            assert new >= self._vt, "virtual time never goes backwards"
            self._vt = new
        due: list[Any] = []
        while sched and sched[0]._when < self._vt + self._clock_resolution:  # as BaseEventLoop does
            h = heapq.heappop(sched)
            if h._cancelled:
                self._timer_cancelled_count -= 1
                continue
            h._scheduled = False
            due.append(h)
            if h._when > self._vt:
                self._vt = h._when  # within clock resolution: a due timer never runs before its time
        if len(due) > 1:
            self.rng.shuffle(due)
        self.timer_events += len(due)
        self._ready.extend(due)

    def _run_once(self) -> None:
        """One iteration, without the selector, I/O and debug machinery of BaseEventLoop's: drop
        cancelled timers at the head (and rebuild the heap when most are cancelled), let due
        timers join the ready queue (jumping virtual time when nothing else is runnable), then run
        what was ready when the iteration began, as BaseEventLoop does."""
        sched, ready = self._scheduled, self._ready
        if len(sched) > 100 and self._timer_cancelled_count * 2 > len(sched):
            live = [h for h in sched if not h._cancelled]
            for h in sched:
                if h._cancelled:
                    h._scheduled = False
            heapq.heapify(live)
            self._scheduled = sched = live
            self._timer_cancelled_count = 0
        while sched and sched[0]._cancelled:
            self._timer_cancelled_count -= 1
            heapq.heappop(sched)._scheduled = False
        if ready or self._stopping:
            if sched and sched[0]._when < self._vt + self._clock_resolution:
                self._advance(0)
        else:
            self._advance(max(0.0, sched[0]._when - self._vt) if sched else None)
        for _ in range(len(ready)):
            handle = ready.popleft()
            if not handle._cancelled:
                handle._run()

    # BaseEventLoop hooks for a loop without file descriptors
    def _process_events(self, event_list: list[Any]) -> None:
        return None

    def _write_to_self(self) -> None:
        return None

    def _make_self_pipe(self) -> None:
        return None

    def _close_self_pipe(self) -> None:
        return None


def run_virtual(main: Coroutine[Any, Any, Any], seed: int = 0) -> tuple[Any, VirtualTimeLoop]:
    """Run ``main`` to completion on a fresh virtual-time loop; returns (result, loop)."""
    loop = VirtualTimeLoop(seed)
    try:
        asyncio.set_event_loop(loop)
        result = loop.run_until_complete(main)
        _cancel_all(loop)
        return result, loop
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def _cancel_all(loop: VirtualTimeLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
