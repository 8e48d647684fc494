"""What the coordinator sends each worker: queued per session, written in order, without a task.

A message is queued on its session (``WorkerSession.outbox``) and the session marked; ``flush``
writes every marked session's queue, what was queued together as one frame (``next_frame``: a
commit decision and the next grant are one Bundle). The coordinator flushes at the end of each
message it handles, so the decision and grants a report completes leave before anything else is
read; whatever is queued elsewhere (a tick, a lost connection) is flushed on the loop's next turn.

A write that cannot finish at once (the socket's buffer above its mark, a degraded link in the
fault wrapper: ``Connection.try_send`` says so) goes to a task of its own, which sends it and what
queues behind it in order, then hands the session back. Until session 32 every session had such a
task, woken through an ``asyncio.Queue`` for every message: at 2 workers that hop was ~40 us of the
time between the last report and the last decision written (docs/BENCHMARKS.md, session 32).

A session whose queue reaches ``OUTBOX_MAX`` is not reading (stuck, or its link is): a message is
never dropped silently (a lost decision or grant would stall it), its connection is closed
instead, so it is suspected now and reconnects when it can.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any

from phalanx.core.errors import TransportError
from phalanx.core.messages import BUNDLE_MAX, Bundle, InjectFault, QuorumAssigned, QuorumBroken, Shutdown, StepDecision

if TYPE_CHECKING:
    from phalanx.core.host import Host
    from phalanx.membership.sessions import WorkerSession

OUTBOX_MAX = 1024
_BUNDLED = (QuorumAssigned, QuorumBroken, StepDecision, InjectFault, Shutdown)


class Outboxes:
    """The coordinator's sending side (see the module)."""

    def __init__(self, host: "Host") -> None:
        self.host = host
        self._marked: list[WorkerSession] = []
        self._flush_due = False

    def queue(self, s: "WorkerSession", message: Any) -> None:
        if not s.connected:
            return
        if len(s.outbox) >= OUTBOX_MAX:
            if not s.conn.is_closed:
                s.conn.close(f"{OUTBOX_MAX} messages queued for {s.worker_id} unsent: it is not reading")
            return
        s.outbox.append(message)
        if s.sending or s.marked:
            return  # its task sends it after what is already under way, or the next flush does
        s.marked = True
        self._marked.append(s)
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Write every marked session's queue now (each stops at a write that must wait)."""
        self._flush_due = False
        marked, self._marked = self._marked, []
        for s in marked:
            s.marked = False
            while s.outbox and s.connected and not s.sending:
                frame = next_frame(s.outbox)
                try:
                    if not s.conn.try_send(frame):
                        s.sending = True
                        self.host.spawn(self._send_waiting(s, frame), f"send-{s.worker_id}")
                except TransportError:
                    s.outbox.clear()  # the connection's loss is noticed (and handled) by its reader

    async def _send_waiting(self, s: "WorkerSession", frame: Any) -> None:
        try:
            await s.conn.send(frame)
            while s.outbox and s.connected:
                await s.conn.send(next_frame(s.outbox))
        except TransportError:
            s.outbox.clear()
        finally:
            s.sending = False


def next_frame(pending: deque[Any]) -> Any:
    """The next frame from the front of ``pending``: one message alone, or the longest run (up to
    BUNDLE_MAX) of messages that may be bundled, as one Bundle."""
    first = pending.popleft()
    if not pending or not isinstance(first, _BUNDLED) or not isinstance(pending[0], _BUNDLED):
        return first
    items = [first]
    while pending and len(items) < BUNDLE_MAX and isinstance(pending[0], _BUNDLED):
        items.append(pending.popleft())
    return Bundle(items=items)
