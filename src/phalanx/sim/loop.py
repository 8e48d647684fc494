"""A virtual-time asyncio event loop: the simulator's clock.

Production protocol code is plain asyncio (futures, queues, ``wait_for``, ``sleep``, ``timeout``), so
the simulator runs it unchanged on this loop. When nothing is runnable the loop jumps straight to
the next timer: no fixed tick, no idle cycles, no real I/O. Timers due at the same instant run in an
order drawn from the seeded RNG, which shakes out ordering assumptions while staying replayable.

It is not asyncio's ``BaseEventLoop``: that loop pays, per callback, a ``Handle`` object with a
debug check, a Python ``__lt__`` for every heap comparison, and a selector round per iteration. Here
a ready callback is a pair of tuples, a timer is a slotted object that waits in its instant's
bucket, the heap holds only the distinct instants (floats, compared in C), and an iteration is a
few lines.
What asyncio's own Futures and Tasks (the C implementations) and the stdlib helpers need from a
loop is here: ``call_soon``, ``call_at``, ``call_later``, ``create_future``, ``create_task`` with a
task factory, ``time``, the exception handler, ``run_until_complete``. ``call_soon`` returns None
(nothing in the protocol, nor in the Futures, Tasks, queues, locks and timeouts it uses, cancels a
``call_soon``); timers return a handle with ``cancel()``, ``cancelled()`` and ``when()``, as
``TimerHandle`` does. A callback runs in the context it was scheduled with, as in asyncio (the
simulated network's task factory reads the creating node from a ContextVar).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import gc
import heapq
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


class VirtualTimer:
    """A scheduled callback: what ``call_at`` and ``call_later`` return (TimerHandle's interface).

    Its slots are filled by the scheduling closure (a class without ``__init__`` is made in C,
    and slot reads are specialised by the interpreter: cheaper than a list's items). ``call`` is
    ``(callback, *args)``, the tuple the scheduling call packed its arguments into, run as
    ``context.run(*call)`` without packing another. The timer waits in its instant's bucket;
    ``draw``, from the loop's seeded RNG, orders the timers due at the same instant (a seeded
    random order, replayable). A cancelled timer's ``call`` is None.
    """

    __slots__ = ("draw", "call", "context", "due_s")
    draw: float
    call: tuple[Any, ...] | None
    context: contextvars.Context
    due_s: float

    def cancel(self) -> None:
        # no bookkeeping: a cancelled timer stays in its bucket until its instant or a compaction
        self.call = None

    def cancelled(self) -> bool:
        return self.call is None

    def when(self) -> float:
        return self.due_s

    def get_context(self) -> contextvars.Context:
        return self.context

    def __repr__(self) -> str:
        call = self.call
        what = "cancelled" if call is None else getattr(call[0], "__qualname__", call[0])
        return f"<VirtualTimer when={self.due_s:.6f} {what}>"


_draw_of = operator.attrgetter("draw")


class VirtualTimeLoop(asyncio.AbstractEventLoop):
    """An event loop whose clock is virtual: see the module docstring."""

    _clock_resolution = 1e-9
    # A simulation allocates futures, timers and messages at a high rate over a large, long-lived
    # heap (thousands of nodes' tasks and sessions): with the default thresholds the cyclic
    # collector's young and full passes took 25-40 % of a 1,024-worker run. While the loop runs,
    # the young generation is collected every 200,000 net allocations instead of 700 (cycles are
    # still collected; the previous thresholds come back when the loop stops).
    gc_thresholds = (200_000, 50, 1000)
    # pending instants (cancelled timers included) before the timer buckets are compacted: grows to
    # twice what a compaction leaves, so compaction costs O(1) per timer amortised
    compact_floor = 1024

    def __init__(self, seed: int = 0) -> None:
        # the virtual clock is a one-item list, read by a C callable: loop.time() is called for
        # every clock reading of every node (4 % of a 1,024-worker run as a Python method)
        self._now = [0.0]
        self.time = functools.partial(operator.getitem, self._now, 0)  # type: ignore[method-assign]
        self.rng = random.Random(f"loop:{seed}")
        self._draw = self.rng.random  # the tie-break of same-instant timers (C, no shuffle pass)
        self.timer_events = 0  # timers fired: the simulator's unit of work
        self.errors: list[str] = []  # unhandled task errors (other than cancellation at teardown)
        self._ready: deque[Any] = deque()  # ((callback, *args), context) pairs
        # Timers wait in buckets, one per distinct instant: {when: [VirtualTimer, ...]} in the
        # order they were scheduled, and a heap of the instants (floats, compared in C without
        # a tuple or list comparison per step of the heap).
        self._buckets: dict[float, list[VirtualTimer]] = {}
        self._instants: list[float] = []
        self._compact_at = self.compact_floor
        self._stopping = False
        self._running = False
        self._closed = False
        self._task_factory: Any = None
        self._exception_handler: Any = self._on_error
        self._debug = False
        self._bind_scheduling()

    def _bind_scheduling(self) -> None:
        """``call_soon``, ``call_at``, ``call_later`` and ``create_future`` as closures over the
        loop's state (no attribute loads per call); ``create_future`` is asyncio's C Future bound
        to this loop (no Python frame). The callback and its arguments arrive packed in one tuple
        (``*call``): asyncio's own callers pass the callback positionally, as documented."""
        now, draw, buckets, instants = self._now, self._draw, self._buckets, self._instants
        append, get = self._ready.append, buckets.get
        copy_context, heappush, timer_of = _copy_context, _heappush, VirtualTimer

        def call_soon(*call: Any, context: contextvars.Context | None = None) -> None:
            append((call, context if context is not None else copy_context()))

        def call_at(when: float, *call: Any, context: contextvars.Context | None = None) -> VirtualTimer:
            timer = timer_of()
            timer.draw, timer.call, timer.due_s = draw(), call, when
            timer.context = context if context is not None else copy_context()
            bucket = get(when)
            if bucket is None:
                buckets[when] = [timer]
                heappush(instants, when)
            else:
                bucket.append(timer)
            return timer

        def call_later(delay: float, *call: Any, context: contextvars.Context | None = None) -> VirtualTimer:
            when = now[0] + delay
            timer = timer_of()
            timer.draw, timer.call, timer.due_s = draw(), call, when
            timer.context = context if context is not None else copy_context()
            bucket = get(when)
            if bucket is None:
                buckets[when] = [timer]
                heappush(instants, when)
            else:
                bucket.append(timer)
            return timer

        self.call_soon = call_soon  # type: ignore[method-assign]
        self.call_at = call_at  # type: ignore[method-assign]
        self.call_later = call_later  # type: ignore[method-assign]
        self.create_future = functools.partial(futures.Future, loop=self)  # type: ignore[method-assign]

    def _on_error(self, loop: Any, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, asyncio.CancelledError):
            return
        if len(self.errors) < 20:
            self.errors.append(f"{context.get('message', '')}: {exc!r}")

    # ---- the clock and scheduling (time, call_soon, call_at, call_later: see __init__) ----
    def call_soon_threadsafe(self, callback: Callable[..., Any], *args: Any,
                             context: contextvars.Context | None = None) -> None:
        # one thread drives a simulation: there is no other thread to be safe from
        self.call_soon(callback, *args, context=context)

    def _due_within_resolution(self) -> list[VirtualTimer]:
        """The timers of the instants that fell due within clock resolution of now, in order
        (BaseEventLoop fires those too); time moves to the latest of them that has a live timer,
        so a due timer never runs before its time."""
        instants, buckets, now = self._instants, self._buckets, self._now
        limit = now[0] + self._clock_resolution
        due: list[VirtualTimer] = []
        while instants and instants[0] < limit:
            when = _heappop(instants)
            bucket = buckets.pop(when)
            if when > now[0] and any(timer.call is not None for timer in bucket):
                now[0] = when
            if len(bucket) > 1:
                bucket.sort(key=_draw_of)
            due += bucket
        return due

    def _compact(self) -> None:
        """Drop cancelled timers from the buckets and their empty instants from the heap."""
        live: dict[float, list[VirtualTimer]] = {}
        for when, bucket in self._buckets.items():
            kept = [timer for timer in bucket if timer.call is not None]
            if kept:
                live[when] = kept
        self._buckets.clear()
        self._buckets.update(live)
        self._instants[:] = live
        heapq.heapify(self._instants)
        self._compact_at = max(self.compact_floor, 2 * len(self._instants))

    def _run_timer(self, timer: VirtualTimer) -> None:
        """A due timer queued behind ready callbacks (after a ``stop()``): runs unless cancelled."""
        call = timer.call
        if call is not None:
            self.timer_events += 1
            call[0](*call[1:])

    def _run(self) -> None:
        """Run virtual instants until ``stop()``. Each: jump virtual time to the next instant with
        a live timer, run its timers in their drawn order (and those due within clock resolution
        of it), then the ready queue until it is empty, callbacks scheduled by callbacks included,
        since virtual time cannot move while they run. (BaseEventLoop runs only what was ready when
        its iteration began, and pays one iteration per hop of every timer -> future -> task
        chain.) Callbacks the timers schedule run after all of the instant's timers; a timer due at
        this same instant but scheduled while they run waits for the next iteration. ``stop()``
        ends an iteration at once, keeping what it had not run. One method, one frame per instant:
        at one timer per instant (most of a cluster run) the per-instant work is most of the cost."""
        ready, instants, buckets, now = self._ready, self._instants, self._buckets, self._now
        popleft, heappop, resolution = ready.popleft, _heappop, self._clock_resolution
        while True:
            if ready or self._stopping:  # after a stop(): timers due now wait behind what is ready
                run_timer = self._run_timer
                ready.extend([((run_timer, timer), timer.context) for timer in self._due_within_resolution()])
            else:
                if len(instants) > self._compact_at:
                    self._compact()
                while True:  # the next instant with a live timer; fully cancelled ones are dropped
                    if not instants:
                        raise SimDeadlock(f"deadlock at virtual t={now[0]:.6f} s: no runnable task and no pending timer")
                    when = heappop(instants)
                    due = buckets.pop(when)
                    if due[0].call is not None or any(timer.call is not None for timer in due):
                        break
                if when > now[0]:
                    now[0] = when
                if len(due) > 1:
                    due.sort(key=_draw_of)
                if instants and instants[0] < when + resolution:
                    due += self._due_within_resolution()
                skipped = 0
                for timer in due:
                    call = timer.call
                    if call is None:  # cancelled, maybe by a timer of this same instant
                        skipped += 1
                        continue
                    try:
                        timer.context.run(*call)
                    except (SystemExit, KeyboardInterrupt):
                        raise
                    except BaseException as exc:
                        self.call_exception_handler({"message": f"Exception in callback {call[0] if call else call!r}", "exception": exc})
                    if self._stopping:
                        ran = due.index(timer) + 1  # timers compare by identity
                        self.timer_events += ran - skipped
                        run_timer = self._run_timer
                        ready.extendleft(reversed([((run_timer, timer), timer.context) for timer in due[ran:]]))
                        return
                self.timer_events += len(due) - skipped
            while ready:
                call, context = popleft()
                try:
                    context.run(*call)
                except (SystemExit, KeyboardInterrupt):
                    raise
                except BaseException as exc:
                    self.call_exception_handler({"message": f"Exception in callback {call[0] if call else call!r}", "exception": exc})
                if self._stopping:
                    return
            if self._stopping:  # stopped before it ran: one round, as an asyncio loop does
                return

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
            self._run()
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
        self._buckets.clear()
        self._instants.clear()

    async def shutdown_asyncgens(self) -> None:
        return None

    async def shutdown_default_executor(self) -> None:
        return None

    # ---- futures and tasks (create_future: see _bind_scheduling) ----
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
