"""A small vocabulary for protocol tests: build a cluster, schedule faults, run, assert on the result.

    r = (Scenario(workers=4, seed=7)
         .crash(3, at_step=10)
         .partition([0, 1], [2, 3], at_step=20, for_s=5.0)
         .run_until(step=50))
    assert r.ok and r.committed_by(3)

Every call adds one ``[[fault]]`` table of the TOML fault-plan format and parses it at once with
the same parser (:func:`phalanx.faults.plan.parse_fault_plan`), so there is one vocabulary: a
scenario builds exactly the ``Fault`` objects a plan file would, and a bad argument fails at the
call that made it, with the plan parser's own message. ``toml()`` prints the plan file it stands for.

``run_until(step=N)`` trains steps 0..N-1: the run ends when every worker that is not
permanently killed has applied step N-1 (or has been told it can no longer catch up), with every
invariant checker on. Workers are indices (0..workers-1); results accept ``3`` or ``"w3"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from phalanx.faults.plan import FaultPlan, parse_fault_plan
from phalanx.sim.cluster import Cluster, SimResult

FaultSpec = dict[str, object]


class Scenario:
    def __init__(self, workers: int, seed: int = 0, **cluster: Any) -> None:
        """``cluster``: further Cluster fields (link, racks, detector, restart_delay_s, ...)."""
        self.workers, self.seed, self.cluster = workers, seed, cluster
        self.faults: list[FaultSpec] = []

    # ---- worker faults ----
    def crash(self, worker: int, *, at_step: int | None = None, at_s: float | None = None,
              restart: bool = True) -> "Scenario":
        """SIGKILL; the process restarts (fresh state) after the cluster's restart_delay_s."""
        return self._add("kill", at_step, at_s, worker=worker, restart=restart)

    def freeze(self, worker: int, *, for_s: float, at_step: int | None = None, at_s: float | None = None) -> "Scenario":
        """SIGSTOP for for_s: no heartbeats, no progress, then SIGCONT."""
        return self._add("freeze", at_step, at_s, worker=worker, for_s=for_s)

    def gil_hang(self, worker: int, *, for_s: float, at_step: int | None = None,
                 at_s: float | None = None) -> "Scenario":
        return self._add("gil_hang", at_step, at_s, worker=worker, for_s=for_s)

    def hang(self, worker: int, *, for_s: float, at_step: int | None = None, at_s: float | None = None) -> "Scenario":
        """Stuck inside the step while its heartbeats keep flowing."""
        return self._add("hang", at_step, at_s, worker=worker, for_s=for_s)

    def straggle(self, worker: int, *, factor: float, for_s: float | None = None, at_step: int | None = None,
                 at_s: float | None = None) -> "Scenario":
        return self._add("straggler", at_step, at_s, worker=worker, factor=factor, for_s=for_s)

    def join(self, worker: int, *, at_step: int | None = None, at_s: float | None = None) -> "Scenario":
        """Not there at the start: the worker's process starts, fresh, at the trigger, heals from a
        peer and then takes part (the first quorum does not wait for it)."""
        return self._add("join", at_step, at_s, worker=worker)

    # ---- network faults ----
    def partition(self, *groups: Sequence[int], for_s: float, at_step: int | None = None, at_s: float | None = None,
                  one_way: bool = False) -> "Scenario":
        """Cut the workers into groups; the coordinator stays with the first group."""
        return self._add("partition", at_step, at_s, groups=[list(g) for g in groups], for_s=for_s,
                         one_way=one_way or None)

    def isolate(self, worker: int, *, for_s: float, at_step: int | None = None,
                at_s: float | None = None) -> "Scenario":
        """Cut one worker off from everyone else (the coordinator included)."""
        return self._add("partition", at_step, at_s, isolate=worker, for_s=for_s)

    def latency(self, *, mean_ms: float, jitter_ms: float | None = None, distribution: str | None = None,
                for_s: float | None = None, at_step: int | None = None, at_s: float | None = None,
                workers: Sequence[int] | None = None, pair: Sequence[int] | None = None) -> "Scenario":
        return self._add("latency", at_step, at_s, mean_ms=mean_ms, jitter_ms=jitter_ms, distribution=distribution,
                         for_s=for_s, **_scope(workers, pair))

    def loss(self, *, probability: float, for_s: float | None = None, at_step: int | None = None,
             at_s: float | None = None, workers: Sequence[int] | None = None,
             pair: Sequence[int] | None = None) -> "Scenario":
        return self._add("loss", at_step, at_s, probability=probability, for_s=for_s, **_scope(workers, pair))

    def bandwidth(self, *, bytes_per_s: float, for_s: float | None = None, at_step: int | None = None,
                  at_s: float | None = None, workers: Sequence[int] | None = None,
                  pair: Sequence[int] | None = None) -> "Scenario":
        return self._add("bandwidth", at_step, at_s, bytes_per_s=bytes_per_s, for_s=for_s, **_scope(workers, pair))

    def duplicate(self, *, probability: float, for_s: float | None = None, at_step: int | None = None,
                  at_s: float | None = None, workers: Sequence[int] | None = None,
                  pair: Sequence[int] | None = None) -> "Scenario":
        """Duplicated segments: TCP drops the copies, the link still carries them."""
        return self._add("duplicate", at_step, at_s, probability=probability, for_s=for_s, **_scope(workers, pair))

    def reorder(self, *, probability: float, delay_ms: float, for_s: float | None = None, at_step: int | None = None,
                at_s: float | None = None, workers: Sequence[int] | None = None,
                pair: Sequence[int] | None = None) -> "Scenario":
        """Reordered segments: TCP delivers in order, so the connection waits (head-of-line)."""
        return self._add("reorder", at_step, at_s, probability=probability, delay_ms=delay_ms, for_s=for_s,
                         **_scope(workers, pair))

    # ---- the coordinator ----
    def kill_coordinator(self, *, at_step: int | None = None, at_s: float | None = None,
                         restart_after_s: float | None = None) -> "Scenario":
        """SIGKILL the coordinator; a new one starts at the same address after restart_after_s (1 s)."""
        return self._add("coordinator_kill", at_step, at_s, restart_after_s=restart_after_s)

    # ---- building and running ----
    @property
    def plan(self) -> FaultPlan:
        return parse_fault_plan(self.toml(), "<scenario>")

    def toml(self) -> str:
        return faults_toml(self.faults)

    def cluster_for(self, steps: int) -> Cluster:
        return Cluster(workers=self.workers, steps=steps, seed=self.seed, plan=self.plan, **self.cluster)

    def run_until(self, *, step: int) -> SimResult:
        """Train steps 0..step-1 with every checker on; see the module docstring."""
        return self.cluster_for(step).run()

    def _add(self, kind: str, at_step: int | None, at_s: float | None, **keys: object) -> "Scenario":
        spec: FaultSpec = {"kind": kind}
        if at_step is not None:
            spec["at_step"] = at_step
        if at_s is not None:
            spec["at_s"] = at_s
        spec.update({k: v for k, v in keys.items() if v is not None})
        parse_fault_plan(faults_toml([spec]), f"<scenario fault #{len(self.faults) + 1}: {kind}>")
        self.faults.append(spec)
        return self


def _scope(workers: Sequence[int] | None, pair: Sequence[int] | None) -> dict[str, object]:
    return {"workers": None if workers is None else list(workers), "pair": None if pair is None else list(pair)}


def faults_toml(faults: list[FaultSpec]) -> str:
    """The fault-plan file for these faults (the format ``--fault-plan`` takes)."""
    out = []
    for f in faults:
        out.append("[[fault]]")
        for k, v in f.items():
            out.append(f"{k} = {_toml(v)}")
        out.append("")
    return "\n".join(out)


def _toml(v: object) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, float):
        return repr(v)  # round-trips exactly (an at_s must land on the instant it names)
    return str(v)
