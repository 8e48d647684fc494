"""When a dead worker's replacement starts: once the survivors have recovered, not during it.

A replacement is a fresh Python process that imports torch before it can do anything: about a
CPU-second of work that no step waits for (it joins at a step boundary and heals from a peer).
Started at once, it competes with the survivors for the cores while they redo the aborted step,
and on a machine the workers share that is the recovery's critical path: a kill recovered in
0.148 s with the restart against 0.105 s without one, in session 23's A/B on 2 cores. On a
cluster the replacement starts on a machine of its own and competes with no one; holding it here
makes one machine behave like that.

So the launcher holds a restart until the job has committed a step since the worker exited (the
survivors have recovered), or for at most ``max_s``, whichever comes first. It does not hold when
nothing could commit without the worker (too few workers left running for a quorum, or no
coordinator in this process to watch), so a restart that the job waits for is never delayed.
The decisions are pure, so they are tested without processes; the launcher polls them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

RESTART_HOLD_MAX_S = 0.5  # at most this long: a job that cannot commit without the worker stops waiting

W = TypeVar("W")


@dataclass(frozen=True)
class _Held(Generic[W]):
    worker: W
    since_s: float
    commits_at_exit: int


class RestartHold(Generic[W]):
    def __init__(self, max_s: float = RESTART_HOLD_MAX_S) -> None:
        if not max_s >= 0:
            raise ValueError(f"restart hold of {max_s!r} s: use 0 (restart at once) or more")
        self.max_s = max_s
        self._held: list[_Held[W]] = []

    def hold(self, worker: W, now_s: float, commits_total: int | None, running: int, min_workers: int) -> bool:
        """Whether to hold ``worker``'s restart (False: start it now). ``commits_total`` is the
        coordinator's count of commits so far (None: no coordinator to watch); ``running`` the
        workers still running besides it."""
        if self.max_s <= 0 or commits_total is None or running < max(min_workers, 1):
            return False
        self._held.append(_Held(worker, now_s, commits_total))
        return True

    def due(self, now_s: float, commits_total: int | None, all_of_them: bool = False) -> list[tuple[W, float]]:
        """The held workers to start now, each with how long it was held: the job committed since
        it exited, it was held ``max_s``, or ``all_of_them`` (nothing else is running to recover)."""
        out, kept = [], []
        for h in self._held:
            recovered = commits_total is not None and commits_total > h.commits_at_exit
            (out if all_of_them or recovered or now_s - h.since_s >= self.max_s else kept).append(h)
        self._held = kept
        return [(h.worker, now_s - h.since_s) for h in out]

    def __len__(self) -> int:
        return len(self._held)
