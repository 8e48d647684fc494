"""Failure detection: heartbeat timeouts plus a step-progress watch. Pure functions of time.

Heartbeats come from a dedicated thread in each worker, so a worker that is SIGKILLed (connection
drops), SIGSTOPped or holding the GIL (heartbeats stop) is caught by ``heartbeat_timeout_s``. A
worker that still heartbeats but makes no step progress (hung in user code or in a collective) is
caught by the progress watch: when another member of the same quorum has moved ahead to a later
phase and this one has not followed within ``progress_timeout_s``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum


class Phase(IntEnum):
    """Where a member is in the current step. Ordered: a larger phase is further along."""

    ASSIGNED = 0  # got its quorum assignment, healing / computing
    ALLREDUCE = 1  # entered the gradient all-reduce
    REPORTED = 2  # reported the all-reduce outcome
    REQUESTED = 3  # asked for the next quorum


@dataclass(frozen=True)
class DetectorConfig:
    heartbeat_interval_s: float = 0.1
    heartbeat_timeout_s: float = 0.6
    progress_timeout_s: float = 2.0


@dataclass(frozen=True)
class Liveness:
    connected: bool
    last_heartbeat_s: float


@dataclass(frozen=True)
class Suspicion:
    worker_id: str
    reason: str


def heartbeat_suspects(now: float, workers: Mapping[str, Liveness], cfg: DetectorConfig) -> list[Suspicion]:
    """Workers whose connection dropped or whose heartbeats stopped."""
    out = []
    for wid in sorted(workers):
        w = workers[wid]
        if not w.connected:
            out.append(Suspicion(wid, "connection lost"))
        elif now - w.last_heartbeat_s > cfg.heartbeat_timeout_s:
            out.append(Suspicion(wid, f"no heartbeat for {now - w.last_heartbeat_s:.2f} s"))
    return out


def own_lateness_s(now: float, due_s: float) -> float:
    """How late a detection tick runs (0 when on time). A late tick means the coordinator itself
    was not running (a GC pause, a starved or SIGSTOPped process): what workers sent meanwhile may
    still be unread in its sockets. A tick a little late (up to the coordinator's ``tick_s``) judges
    silence as of when it was due; one later judges none, and the next tick, ``tick_s`` on, judges
    by the clock (by then the readers have caught up). Without this a 1 s stall of the coordinator
    blamed every worker and aborted the step. A tick is due at the quietest worker's timeout, so
    a stall that spans it would blame that worker if judged as of then. Detection waits for the
    stall and one tick more, and the lateness is at most the stall (the ticker may have been asleep
    when it began)."""
    return max(0.0, now - due_s)


def progress_suspects(now: float, phases: Mapping[str, tuple[Phase, float]], cfg: DetectorConfig) -> list[Suspicion]:
    """Members left behind: another member reached a later phase over progress_timeout_s ago.

    ``phases`` maps each member of the current quorum to (its phase, when it entered it).
    """
    if len(phases) < 2:
        return []
    lead = max(p for p, _ in phases.values())
    # When did the first member reach the leading phase? That is when the others fell behind.
    lead_since = min(t for p, t in phases.values() if p == lead)
    if now - lead_since <= cfg.progress_timeout_s:
        return []
    return [
        Suspicion(wid, f"no step progress for {now - lead_since:.2f} s while peers reached {lead.name.lower()}")
        for wid in sorted(phases)
        if phases[wid][0] < lead
    ]


# A due time is checked this long after the moment its timeout runs out: the checks above are
# strict (silence *over* the timeout), and a loop with whole-millisecond timers may fire early.
DUE_MARGIN_S = 0.002


def heartbeat_due_s(earliest_heard_s: float, cfg: DetectorConfig) -> float:
    """When the quietest healthy worker (last heard at ``earliest_heard_s``) turns suspect if it
    stays silent. Every message moves a worker's mark later and a new one starts at its Hello, so
    no worker can turn suspect before this: a detection pass earlier would find nothing."""
    return earliest_heard_s + cfg.heartbeat_timeout_s + DUE_MARGIN_S


def progress_due_s(now: float, phases: Mapping[str, tuple[Phase, float]], cfg: DetectorConfig) -> float:
    """The earliest moment :func:`progress_suspects` can name anyone, given the phases now.

    With a member behind the lead, that is the lead's start plus the timeout. With none behind,
    nobody can fall behind before a member moves ahead, which happens now or later: now plus the
    timeout. (One exception the caller handles: a Progress mark is backdated to when its phase
    began, so its handler brings the check forward itself.)"""
    if not phases:
        return progress_deadline_s(now, cfg)
    lead = max(p for p, _ in phases.values())
    behind = any(p < lead for p, _ in phases.values())
    return progress_deadline_s(min(t for p, t in phases.values() if p == lead) if behind else now, cfg)


def progress_deadline_s(lead_since_s: float, cfg: DetectorConfig) -> float:
    """When members behind a lead taken at ``lead_since_s`` turn suspect (plus the margin)."""
    return lead_since_s + cfg.progress_timeout_s + DUE_MARGIN_S
