"""Model versions during a rollout: pure decisions (no clock, no I/O).

Every replica serves one version (``<run>/step_<n>``, named in every response). The router ranks
versions in the order it rolled them out: a version first seen on a replica (the one it started
with, or a replica that joined) is the base, rank 0; each rollout target gets the next rank. In
``consistent`` mode a session (the request's ``user`` field or an ``X-Session-Id`` header) never
sees a lower rank after a higher one: the router remembers each session's highest rank (bounded
LRU) and routes it only to replicas at that rank or above. In ``available`` mode any healthy
replica serves (regressions are possible and counted by the benchmark). A stream resumed after a
failure continues only on a replica of the *same* version, whatever the mode: the tokens already
streamed came from those weights.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

SESSION_HEADER = "x-session-id"
SESSIONS_MAX = 100_000  # remembered sessions; the least recently used are forgotten first
SESSION_ID_CHARS_MAX = 256


class Consistency(str, Enum):
    CONSISTENT = "consistent"  # a session never sees an older version after a newer one
    AVAILABLE = "available"  # any healthy replica (a session may go back a version mid-rollout)


class VersionBook:
    """Version -> rank, in rollout order (unknown versions are the base, rank 0)."""

    def __init__(self) -> None:
        self.ranks: dict[str, int] = {}

    def rank(self, version: str) -> int:
        return self.ranks.get(version, 0)

    def learn(self, version: str) -> int:
        """A version seen on a replica, not rolled out by this router: the base unless already ranked."""
        return self.ranks.setdefault(version, 0)

    def promote(self, version: str) -> int:
        """The target of a rollout becomes the newest version (also when it is an older checkpoint rolled
        back to: newer means rolled out later)."""
        top = max(self.ranks.values(), default=0)
        if self.ranks.get(version, -1) < top or top == 0:
            self.ranks[version] = top + 1
        return self.ranks[version]


class SessionVersions:
    """The highest version rank each session has seen (bounded LRU)."""

    def __init__(self, entries_max: int = SESSIONS_MAX) -> None:
        self.entries_max = entries_max
        self.floor_by_session: OrderedDict[str, int] = OrderedDict()

    def floor(self, session: str | None) -> int:
        if session is None or session not in self.floor_by_session:
            return 0
        self.floor_by_session.move_to_end(session)
        return self.floor_by_session[session]

    def observe(self, session: str | None, rank: int) -> None:
        if session is None:
            return
        if rank > self.floor_by_session.get(session, -1):
            self.floor_by_session[session] = rank
        self.floor_by_session.move_to_end(session)
        while len(self.floor_by_session) > self.entries_max:
            self.floor_by_session.popitem(last=False)

    def __len__(self) -> int:
        return len(self.floor_by_session)


def session_of(body: Mapping[str, object], header: str | None) -> str | None:
    """The session a request belongs to: ``X-Session-Id`` first, else the OpenAI ``user`` field."""
    for v in (header, body.get("user")):
        if isinstance(v, str) and v:
            return v[:SESSION_ID_CHARS_MAX]
    return None


@dataclass(frozen=True)
class ReplicaVersion:
    replica_id: str
    version: str
    rank: int
    admitting: bool  # False while a rollout drains or reloads it


def excluded_for(replicas: list[ReplicaVersion], mode: Consistency, floor: int, pinned: str | None = None
                 ) -> tuple[frozenset[str], str]:
    """Replicas a request may not use, and why. ``pinned``: a resumed stream's version (only replicas
    serving exactly that version, draining ones included: the stream is a continuation, not new work)."""
    if pinned is not None:
        out = frozenset(r.replica_id for r in replicas if r.version != pinned)
        return out, f"resumed stream pinned to {pinned}"
    out = {r.replica_id for r in replicas if not r.admitting}
    why = "draining for the rollout" if out else "none"
    if mode is Consistency.CONSISTENT and floor > 0:
        low = {r.replica_id for r in replicas if r.rank < floor}
        if low:
            why = f"session has seen rank {floor}; {len(low)} replica(s) serve older versions"
        out |= low
    return frozenset(out), why


def next_to_swap(replicas: list[tuple[str, str, bool]], target: str, done: frozenset[str]
                 ) -> tuple[str | None, bool, str]:
    """The rollout's next replica in id order, from (replica_id, version, healthy) triples: (id, True)
    to swap it; (id, False) to skip it, out of rotation (it serves nobody; the next rollout or its
    restart brings it up to date); (None, False) when every replica is done."""
    for rid, version, healthy in sorted(replicas):
        if version == target or rid in done:
            continue
        if not healthy:
            return rid, False, f"{rid} is out of rotation: skipped"
        return rid, True, f"{rid} serves {version}: swap it"
    return None, False, f"every replica serves {target} or was skipped"
