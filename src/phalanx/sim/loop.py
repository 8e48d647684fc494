"""A virtual-time asyncio event loop: the simulator's clock.

Production protocol code is plain asyncio (futures, queues, ``wait_for``, ``sleep``, ``timeout``), so
the simulator runs it unchanged on this loop. When nothing is runnable the loop jumps straight to
the next timer: no fixed tick, no idle cycles, no real I/O. Timers due at the same instant run in an
order drawn from the seeded RNG, which shakes out ordering assumptions while staying replayable.

It is not asyncio's ``BaseEventLoop``: that loop pays, per callback, a ``Handle`` object with a
debug check, a Python ``__lt__`` for every heap comparison, and a selector round per iteration. Here
a ready callback is a tuple, a timer is a list that is its own heap entry (built and compared in
C), and an iteration is a few lines. What asyncio's own Futures and Tasks (the C
implementations) and the stdlib helpers need from a loop is here: ``call_soon``, ``call_at``,
``call_later``, ``create_future``, ``create_task`` with a task factory, ``time``, the exception
handler, ``run_until_complete``. ``call_soon`` returns None (nothing in the protocol, nor in the
Futures, Tasks, queues, locks and timeouts it uses, cancels a ``call_soon``); timers return a
handle with ``cancel()``, ``cancelled()`` and ``when()``, as ``TimerHandle`` does.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import gc
import heapq
import itertools
import logging
import operator
import random
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from asyncio import events, futures, tasks

_log = logging.getLogger(__name__)
_copy_context = contextvars.copy_context
_heappush, _heappop = heapq.heappush, heapq.heappop


class SimDeadlock(RuntimeError):
    """Nothing is runnable and no timer is pending, but the awaited work has not finished."""


class VirtualTimer(list):  # type: ignore[type-arg]
    """A scheduled callback: what ``call_at`` and ``call_later`` return (TimerHandle's interface).

    It is its own heap entry, ``[when, draw, seq, callback, args, context, loop, scheduled]``: built
    by list's C constructor (no Python ``__init__`` per timer) and ordered in C by when, then by a
    number drawn from the loop's seeded RNG (so timers due at the same instant run in a seeded
    random order without a shuffle), then by seq, which is unique. A cancelled timer's callback
    is None.
    """

    __slots__ = ()

    def cancel(self) -> None:
        if self[3] is not None:
            self[3] = self[4] = None
            if self[7]:
                self[6]._cancelled_timers += 1

    def cancelled(self) -> bool:
        return self[3] is None

    def when(self) -> float:
        return self[0]  # type: ignore[no-any-return]

    def get_context(self) -> contextvars.Context:
        return self[5]  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        cb = self[3]
        return f"<VirtualTimer when={self[0]:.6f} {'cancelled' if cb is None else getattr(cb, '__qualname__', cb)}>"


class VirtualTimeLoop(asyncio.AbstractEventLoop):
    """An event loop whose clock is virtual: see the module docstring."""

    _clock_resolution = 1e-9
    # A simulation allocates futures, timers and messages at a high rate over a large, long-lived
    # heap (thousands of nodes' tasks and sessions): with the default thresholds the cyclic
    # collector's young and full passes took 25-40 % of a 1,024-worker run. While the loop runs,
    # the young generation is collected every 200,000 net allocations instead of 700 (cycles are
    # still collected; the previous thresholds come back when the loop stops).
    gc_thresholds = (200_000, 50, 1000)

    def __init__(self, seed: int = 0) -> None:
        # the virtual clock is a one-item list, read by a C callable: loop.time() is called for
        # every clock reading of every node (4 % of a 1,024-worker run as a Python method)
        self._now = [0.0]
        self.time = functools.partial(operator.getitem, self._now, 0)  # type: ignore[method-assign]
        self.rng = random.Random(f"loop:{seed}")
        self._draw = self.rng.random  # the tie-break of same-instant timers (C, no shuffle pass)
        self.timer_events = 0  # timers fired: the simulator's unit of work
        self.errors: list[str] = []  # unhandled task errors (other than cancellation at teardown)
        self._ready: deque[Any] = deque()  # (callback, args, context) tuples and fired VirtualTimers
        self._heap: list[VirtualTimer] = []
        self._seq = itertools.count()
        self._cancelled_timers = 0  # cancelled timers still in the heap
        self._stopping = False
        self._running = False
        self._closed = False
        self._task_factory: Any = None
        self._exception_handler: Any = self._on_error
        self._debug = False

    def _on_error(self, loop: Any, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, asyncio.CancelledError):
            return
        if len(self.errors) < 20:
            self.errors.append(f"{context.get('message', '')}: {exc!r}")

    # ---- the clock and scheduling ----
    def time(self) -> float:
        return self._now[0]

    def call_soon(self, callback: Callable[..., Any], *args: Any, context: contextvars.Context | None = None) -> None:
        self._ready.append((callback, args, context if context is not None else _copy_context()))

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any,
                context: contextvars.Context | None = None) -> VirtualTimer:
        timer = VirtualTimer((when, self._draw(), next(self._seq), callback, args,
                              context if context is not None else _copy_context(), self, True))
        _heappush(self._heap, timer)
        return timer

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any,
                   context: contextvars.Context | None = None) -> VirtualTimer:
        timer = VirtualTimer((self._now[0] + delay, self._draw(), next(self._seq), callback, args,
                              context if context is not None else _copy_context(), self, True))
        _heappush(self._heap, timer)
        return timer

    def call_soon_threadsafe(self, callback: Callable[..., Any], *args: Any,
                             context: contextvars.Context | None = None) -> None:
        # one thread drives a simulation: there is no other thread to be safe from
        self.call_soon(callback, *args, context=context)

    def _advance(self, to_next_timer: bool) -> None:
        """Move every timer due now into the ready queue (same-instant timers in their drawn
        order); when nothing else is runnable (``to_next_timer``), first jump virtual time to the
        next live timer."""
        heap, now = self._heap, self._now
        heappop = _heappop
        while heap and heap[0][3] is None:  # drop cancelled timers at the head
            heappop(heap)[7] = False
            self._cancelled_timers -= 1
        if to_next_timer:
            if not heap:
                raise SimDeadlock(f"deadlock at virtual t={self._now[0]:.6f} s: no runnable task and no pending timer")
            when = heap[0][0]
            if when > now[0]:
                now[0] = when
        limit = now[0] + self._clock_resolution
        append = self._ready.append
        fired = 0
        while heap and heap[0][0] < limit:  # as BaseEventLoop does
            timer = heappop(heap)
            timer[7] = False
            if timer[3] is None:
                self._cancelled_timers -= 1
                continue
            append(timer)
            fired += 1
            if timer[0] > now[0]:
                now[0] = timer[0]  # within clock resolution: a due timer never runs before its time
        self.timer_events += fired

    def _compact(self) -> None:
        """Rebuild the heap without its cancelled timers once they are most of it."""
        live = []
        for timer in self._heap:
            if timer[3] is None:
                timer[7] = False
            else:
                live.append(timer)
        heapq.heapify(live)
        self._heap = live
        self._cancelled_timers = 0

    def _run_once(self) -> None:
        """One virtual instant: due timers join the ready queue (jumping virtual time when nothing
        else is runnable), then the ready queue runs until it is empty, callbacks scheduled by
        callbacks included, since virtual time cannot move while they run. (BaseEventLoop runs
        only what was ready when its iteration began, and pays one iteration per hop of every
        timer -> future -> task chain.) A timer due at this same instant but scheduled during the
        drain waits for the next one; ``stop()`` ends the drain at once."""
        if self._cancelled_timers > 100 and self._cancelled_timers * 2 > len(self._heap):
            self._compact()
        ready = self._ready
        self._advance(not ready and not self._stopping)
        popleft = ready.popleft
        while ready:
            item = popleft()
            if item.__class__ is tuple:
                callback, args, context = item
            else:
                callback = item[3]
                if callback is None:  # cancelled after it fell due
                    continue
                args, context = item[4], item[5]
            try:
                context.run(callback, *args)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self.call_exception_handler({"message": f"Exception in callback {callback!r}", "exception": exc})
            if self._stopping:
                break

    # ---- running ----
    def run_forever(self) -> None:
        if self._running:
            raise RuntimeError("this event loop is already running")
        if events._get_running_loop() is not None:
            raise RuntimeError("cannot run the virtual-time loop while another loop is running")
        self._running = True
        events._set_running_loop(self)
        thresholds = gc.get_threshold()
        gc.set_threshold(*self.gc_thresholds)
        try:
            while True:
                self._run_once()
                if self._stopping:
                    break
        finally:
            gc.set_threshold(*thresholds)
            self._stopping = False
            self._running = False
            events._set_running_loop(None)

    def run_until_complete(self, future: Any) -> Any:
        if self._closed:
            raise RuntimeError("event loop is closed")
        fut = tasks.ensure_future(future, loop=self)
        fut.add_done_callback(self._stop_when_done)
        try:
            self.run_forever()
        finally:
            fut.remove_done_callback(self._stop_when_done)
        if not fut.done():
            raise RuntimeError("event loop stopped before the future completed")
        return fut.result()

    def _stop_when_done(self, fut: Any) -> None:
        self.stop()

    def stop(self) -> None:
        self._stopping = True

    def is_running(self) -> bool:
        return self._running

    def is_closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._running:
            raise RuntimeError("cannot close a running event loop")
        self._closed = True
        self._ready.clear()
        self._heap.clear()

    async def shutdown_asyncgens(self) -> None:
        return None

    async def shutdown_default_executor(self) -> None:
        return None

    # ---- futures and tasks ----
    def create_future(self) -> asyncio.Future[Any]:
        return futures.Future(loop=self)

    def create_task(self, coro: Coroutine[Any, Any, Any], *, name: str | None = None,
                    context: contextvars.Context | None = None) -> asyncio.Task[Any]:
        if self._task_factory is None:
            return tasks.Task(coro, loop=self, name=name, context=context)
        task = (self._task_factory(self, coro) if context is None
                else self._task_factory(self, coro, context=context))
        if name is not None:
            task.set_name(name)
        return task

    def set_task_factory(self, factory: Any) -> None:
        self._task_factory = factory

    def get_task_factory(self) -> Any:
        return self._task_factory

    # ---- errors and debug ----
    def set_exception_handler(self, handler: Any) -> None:
        self._exception_handler = handler

    def get_exception_handler(self) -> Any:
        return self._exception_handler

    def default_exception_handler(self, context: dict[str, Any]) -> None:
        _log.error("%s", context.get("message", "unhandled exception in the virtual-time loop"),
                   exc_info=context.get("exception"))

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        if self._exception_handler is None:
            self.default_exception_handler(context)
            return
        try:
            self._exception_handler(self, context)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException:
            self.default_exception_handler(context)

    # asyncio's C Future calls loop.get_debug() as each future is made (hundreds of thousands per
    # simulated run): ``bool`` returns False without a Python frame (1.6 % of a 1,024-worker run)
    get_debug = staticmethod(bool)

    def set_debug(self, enabled: bool) -> None:
        self._debug = bool(enabled)
        self.get_debug = (lambda: True) if self._debug else bool  # type: ignore[method-assign]



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
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
