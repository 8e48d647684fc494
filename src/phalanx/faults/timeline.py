"""When a fault fires and what it did: one meaning for real runs and the simulator.

Triggers (the same on both sides, so one plan file puts a fault at the same point of a run):

- ``at_step = N``: once step N-1 has committed, i.e. as the cluster's next step is N (checked
  every ``POLL_S``, so the fault lands at a varying point early in step N).
- ``at_s = T``: T seconds after the **first committed step**. Process start-up, rendezvous and the
  first quorum take very different times on a real machine and in virtual time; counting from the
  first commit puts the fault at the same point of the training on both.

Detection and recovery are computed from the coordinator's events, once: a worker fault is
detected at the first suspicion of one of its targets and recovered at the first commit after
that; a coordinator kill is detected when the restarted coordinator admits its first worker; a
join has nothing to detect and is recovered at the first commit that includes the joiner.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from phalanx.faults.plan import Fault, FaultKind

POLL_S = 0.005  # how often an at_step trigger is checked


@dataclass
class FaultRecord:
    kind: str
    worker: int | None
    at_step: int  # the cluster's next step when it fired
    injected_s: float  # on the run's clock (monotonic on real runs, virtual in the simulator)
    description: str
    targets: tuple[str, ...] = ()  # workers whose suspicion counts as detecting it
    detected_after_s: float | None = None
    recovered_after_s: float | None = None
    ended_after_s: float | None = None  # when a timed fault (freeze, hang, partition) was lifted
    restarted: bool = False  # coordinator kill: the replacement is listening

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "worker": self.worker, "at_step": self.at_step, "description": self.description,
                "detected_after_s": _r(self.detected_after_s), "recovered_after_s": _r(self.recovered_after_s),
                "ended_after_s": _r(self.ended_after_s), "targets": list(self.targets)}

    def end(self, now_s: float) -> None:
        self.ended_after_s = now_s - self.injected_s


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


class FaultTimeline:
    """The trigger clock and the records of one run (shared by everything that injects faults)."""

    def __init__(self) -> None:
        self.first_commit_s: float | None = None
        self.records: list[FaultRecord] = []

    def due_at(self, f: Fault) -> float | None:
        """The instant an ``at_s`` fault fires, once the first step has committed (else None)."""
        if f.at_s is None or self.first_commit_s is None:
            return None
        return self.first_commit_s + f.at_s

    def is_due(self, f: Fault, next_step: int, now_s: float) -> bool:
        if f.at_step is not None:
            return next_step >= f.at_step
        at = self.due_at(f)
        return at is not None and now_s >= at

    async def wait_until_due(self, f: Fault, next_step: Callable[[], int], now: Callable[[], float],
                             sleep: Callable[[float], Awaitable[None]]) -> None:
        """Returns when ``f`` is due: polls at_step; sleeps to the exact instant of at_s."""
        while not self.is_due(f, next_step(), now()):
            at = self.due_at(f)
            await sleep(POLL_S if at is None else max(0.0, at - now()))

    def record(self, f: Fault, next_step: int, now_s: float, targets: tuple[str, ...] = (),
               worker: int | None = None) -> FaultRecord:
        rec = FaultRecord(f.kind.value, f.worker if worker is None else worker, next_step, now_s, f.describe(),
                          targets or ((f"w{f.worker}",) if f.worker is not None else ()))
        self.records.append(rec)
        return rec

    def observe(self, ev: dict[str, Any], now_s: float) -> None:
        """Fed every coordinator event: the first commit, and detection and recovery of each fault."""
        name = ev.get("event")
        if name == "step_committed" and self.first_commit_s is None:
            self.first_commit_s = now_s
        for r in self.records:
            if r.kind == FaultKind.JOIN.value:
                if r.recovered_after_s is None and name == "step_committed" and \
                        set(r.targets) & set(ev.get("members", ())):
                    r.recovered_after_s = now_s - r.injected_s
            elif r.detected_after_s is None:
                if (name == "worker_suspected" and ev.get("worker") in r.targets) or \
                        (name == "worker_joined" and r.restarted):
                    r.detected_after_s = now_s - r.injected_s
            elif r.recovered_after_s is None and name == "step_committed":
                r.recovered_after_s = now_s - r.injected_s
