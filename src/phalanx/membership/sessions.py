"""The coordinator's worker sessions, and the counts behind its fast paths, owned in one place.

The coordinator asks "is every healthy worker asking for a quorum?" on every quorum request; with
thousands of simulated workers a recount per message would cost O(workers^2) per step. So the
counts are kept current here, by the only methods that change what they count, and each tick the
coordinator asserts they equal a recount (``check_counts``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from phalanx.core.host import Connection
from phalanx.membership import failure_detector as fd


class SuspicionCause(Enum):
    """Why a worker is out of the quorum: behaviour keys on this, never on the reason text."""

    NO_HEARTBEAT = "no heartbeat"  # frozen, GIL held, partitioned: cleared when heartbeats resume
    NO_PROGRESS = "no step progress"  # hung in a step: cleared when it asks for a quorum again
    CONNECTION_LOST = "connection lost"
    REPLACED = "replaced by a new incarnation"


@dataclass
class WorkerSession:
    worker_id: str
    incarnation: str
    conn: Connection
    pid: int
    heal_address: str
    joined_at_s: float
    last_heartbeat_s: float
    last_committed_step: int
    has_state: bool
    connected: bool = True
    cause: SuspicionCause | None = None  # set: out of the quorum, and why
    suspected: str = ""  # the human-readable reason (events, progress display)
    waiting: bool = False
    waiting_since_s: float = 0.0
    # its quorum request was still unanswered when it was suspected: a worker that comes back (its
    # heartbeats resume after a partition or freeze) is still waiting on that request
    asked_when_suspected: bool = False
    phase: tuple[fd.Phase, float] = (fd.Phase.REQUESTED, 0.0)
    done: bool = False
    # said Goodbye holding the final state and still connected: a heal source for late workers
    holds_final: bool = False
    released: bool = False  # told it may leave (no worker can still need its final state)
    requested_step: int = -1  # the step number the worker asked a quorum for (local-sgd: its local step)
    asks_next: int = -1  # the fast path: the step it asked for in its report, should that step commit
    members_sent_for: int = -1  # the quorum id whose member list this connection was sent
    left_at_s: float = -1.0  # when it disconnected (-1: connected)
    outbox: deque[Any] = field(default_factory=deque)  # queued to send (membership/outbox.py)
    marked: bool = False  # its outbox waits for the next flush
    sending: bool = False  # a send that had to wait is under way on a task: the rest follows it

    @property
    def healthy(self) -> bool:
        return self.connected and self.cause is None and not self.done


def _counted(s: WorkerSession) -> tuple[int, int]:
    healthy = s.healthy
    return int(healthy), int(healthy and s.waiting)


class Sessions:
    """Sessions by worker id (iterated in sorted order), with ``healthy_n`` and ``waiting_n``."""

    def __init__(self) -> None:
        self._by_id: dict[str, WorkerSession] = {}
        self._order: tuple[WorkerSession, ...] | None = None  # sorted by id, until one is admitted or removed
        self.healthy_n = 0
        self.waiting_n = 0  # healthy sessions asking for a quorum

    # ---- reading ----
    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._by_id

    def __getitem__(self, worker_id: str) -> WorkerSession:
        return self._by_id[worker_id]

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, worker_id: str) -> WorkerSession | None:
        return self._by_id.get(worker_id)

    def values(self) -> tuple[WorkerSession, ...]:
        """Every session, in id order (cached until one is admitted or removed)."""
        if self._order is None:
            by_id = self._by_id
            self._order = tuple(by_id[k] for k in sorted(by_id))
        return self._order

    def unordered(self) -> Iterator[WorkerSession]:
        """For hot paths whose result does not depend on order (filters, counts)."""
        return iter(self._by_id.values())

    def everyone_asking(self) -> bool:
        return self.waiting_n >= self.healthy_n

    # ---- changing: every change goes through _change, which keeps the counts ----
    @contextmanager
    def _change(self, s: WorkerSession) -> Iterator[None]:
        mine = self._by_id.get(s.worker_id) is s
        h0, w0 = _counted(s) if mine else (0, 0)
        yield
        h1, w1 = _counted(s) if self._by_id.get(s.worker_id) is s else (0, 0)
        self.healthy_n += h1 - h0
        self.waiting_n += w1 - w0

    def admit(self, s: WorkerSession) -> WorkerSession | None:
        """Add a new incarnation; returns the session it replaces, if any (no longer counted)."""
        old = self._by_id.get(s.worker_id)
        if old is not None:
            with self._change(old):
                del self._by_id[s.worker_id]
        self._order = None  # a new incarnation is a new object: the cached order holds the old one
        self._by_id[s.worker_id] = s
        h, w = _counted(s)
        self.healthy_n, self.waiting_n = self.healthy_n + h, self.waiting_n + w
        return old

    def remove(self, s: WorkerSession) -> None:
        if self._by_id.get(s.worker_id) is s:
            with self._change(s):
                del self._by_id[s.worker_id]
            self._order = None

    def set_waiting(self, s: WorkerSession, waiting: bool, now: float = 0.0) -> None:
        # _change's bookkeeping written out (twice per worker and step): only the waiting count
        # can move, and only for a counted, healthy session
        if s.waiting != waiting and self._by_id.get(s.worker_id) is s and s.healthy:
            self.waiting_n += 1 if waiting else -1
        if waiting:
            s.waiting_since_s = now
        s.waiting = waiting

    def suspect(self, s: WorkerSession, cause: SuspicionCause, reason: str) -> bool:
        """Out of the quorum; False if it already was (or is done)."""
        if s.cause is not None or s.done:
            return False
        with self._change(s):
            s.asked_when_suspected = s.waiting
            s.cause, s.suspected, s.waiting = cause, reason, False
        return True

    def clear_suspicion(self, s: WorkerSession, now: float) -> None:
        """Back in: a worker suspected while its request was unanswered is still waiting on it."""
        with self._change(s):
            s.cause, s.suspected = None, ""
            if s.asked_when_suspected and not s.waiting:
                s.waiting, s.waiting_since_s = True, now
            s.asked_when_suspected = False

    def disconnect(self, s: WorkerSession, now: float) -> None:
        with self._change(s):
            s.connected, s.left_at_s = False, now

    def finish(self, s: WorkerSession) -> None:
        with self._change(s):
            s.done, s.waiting = True, False

    def prune(self, now: float, keep_s: float, protected: frozenset[str]) -> list[str]:
        """Forget sessions that left over ``keep_s`` ago and are done, or were replaced; never one
        in ``protected`` (members of the current quorum). Bounded memory over long runs."""
        gone = [w for w, s in self._by_id.items()
                if not s.connected and s.left_at_s >= 0 and now - s.left_at_s > keep_s and s.done
                and w not in protected]
        for w in gone:
            self.remove(self._by_id[w])
        return sorted(gone)

    def check_counts(self) -> None:
        h = sum(1 for s in self._by_id.values() if s.healthy)
        w = sum(1 for s in self._by_id.values() if s.healthy and s.waiting)
        assert (self.healthy_n, self.waiting_n) == (h, w), \
            f"session counts drifted: kept {(self.healthy_n, self.waiting_n)}, recount {(h, w)}"
