"""One training job, real or simulated, as the experiments read it: its coordinator events.

Real jobs go through the launcher (the bundled char-LM on local worker processes, as ``phalanx
train`` runs it) so that lab switches can set the detector and quorum configuration the launcher
already takes; simulated jobs through ``sim.Cluster``. Both leave the same event vocabulary
(``fault_injected``, ``worker_suspected``, ``step_aborted``, ``step_committed``) on one clock per
run, which is all the measurements below use.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx.core.errors import ConfigError
from phalanx.core.modes import ConsistencyMode, ModeConfig
from phalanx.faults.plan import EMPTY_PLAN, FaultPlan
from phalanx.lab.switches import ALL_ON, NEVER_S, LabSwitches
from phalanx.membership.failure_detector import DetectorConfig
from phalanx.sim.scenario import Scenario

Faults = Callable[[Scenario], Scenario]
# timeout_margin off: a heartbeat timeout sized for a local link (the 0.1 s interval + 50 ms), not 0.6 s
LOCAL_CALL_TIMEOUT_S = 0.15


@dataclass
class JobRun:
    ok: bool
    reason: str
    events: list[dict[str, Any]]
    faults: list[dict[str, Any]]
    wall_s: float
    simulated: bool
    summary: dict[str, Any] = field(default_factory=dict)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]

    def commit_times_s(self) -> list[float]:
        return [float(e["t"]) for e in self.of("step_committed")]

    def steps_committed(self) -> int:
        return len({e["step"] for e in self.of("step_committed")})

    def step_intervals_s(self) -> list[float]:
        """Time between successive commits (the job's step time, stalls included)."""
        t = self.commit_times_s()
        return [b - a for a, b in zip(t, t[1:])]

    def median_step_s(self) -> float | None:
        iv = self.step_intervals_s()
        return statistics.median(iv) if iv else None

    def injected_at_s(self) -> list[float]:
        return [float(e["t"]) for e in self.of("fault_injected")]

    def false_suspicions(self) -> int:
        targeted = {e.get("worker") for e in self.of("fault_injected")}
        return sum(1 for e in self.of("worker_suspected") if e.get("worker") not in targeted)

    def end_s(self) -> float | None:
        """When the run ended on its own clock (a hung simulated run: at its deadline)."""
        if self.simulated:
            return float(self.summary.get("virtual_s", 0.0))
        # the coordinator's clock starts with the launch; a hung job emits nothing until the launcher
        # stops it, so its wall time is the better end (they differ by the coordinator's start-up)
        times = [float(e["t"]) for e in self.events if "t" in e]
        return max([self.wall_s, *times])

    def longest_stall_s(self) -> float:
        """The longest time without a commit, counting the time from the last commit to the end."""
        t = self.commit_times_s()
        gaps = self.step_intervals_s()
        end = self.end_s()
        if t and end is not None and not self.ok:
            gaps.append(end - t[-1])
        return max(gaps) if gaps else 0.0

    def last_commit_s(self) -> float | None:
        t = self.commit_times_s()
        return t[-1] if t else None


# the switches each kind of job acts on; any other switch off is refused rather than silently ignored
_DETECTION = {"deadlines", "progress_detector", "collective_deadline", "timeout_margin"}
_MODES = {"adaptive_shares", "infrequent_sync"}
SIM_HONOURS = _DETECTION | _MODES | {"bandwidth_optimal_allreduce", "elastic_membership"}
REAL_HONOURS = _DETECTION | _MODES | {"elastic_membership"}


def modes_for(sw: LabSwitches, modes: ModeConfig) -> ModeConfig:
    """adaptive_shares or infrequent_sync off: strict mode (equal shares, an all-reduce every step)
    whatever mode the experiment asked for with the mechanism on."""
    if sw.adaptive_shares and sw.infrequent_sync:
        return modes
    return dataclasses.replace(modes, mode=ConsistencyMode.STRICT)


def _refuse_unhonoured(sw: LabSwitches, honoured: set[str], what: str) -> None:
    ignored = [name for name in sw.off() if name not in honoured]
    if ignored:
        raise ConfigError(f"{what} cannot switch off {', '.join(ignored)}; it acts on {', '.join(sorted(honoured))} "
                          "(the others have their own experiment: see phalanx.lab.switches.OFF_MEANS)")


def detector_for(sw: LabSwitches, base: DetectorConfig = DetectorConfig()) -> DetectorConfig:
    hb = base.heartbeat_timeout_s if sw.timeout_margin else LOCAL_CALL_TIMEOUT_S
    if not sw.deadlines:
        return DetectorConfig(base.heartbeat_interval_s, NEVER_S, NEVER_S)
    return DetectorConfig(base.heartbeat_interval_s, hb, base.progress_timeout_s if sw.progress_detector else NEVER_S)


def collective_timeout_for(sw: LabSwitches, base_s: float = 5.0) -> float:
    return base_s if sw.deadlines and sw.collective_deadline else NEVER_S


def run_sim(workers: int, steps: int, faults: Faults | None = None, *, seed: int = 0, sw: LabSwitches = ALL_ON,
            deadline_s: float = 120.0, collective_timeout_s: float = 5.0, **cluster: Any) -> JobRun:
    """A simulated job; ``deadline_s`` bounds its virtual time (a hung job ends there, not ok)."""
    from phalanx.sim.process_group import CollectiveModel

    if not sw.bandwidth_optimal_allreduce:
        base = cluster.get("collective", CollectiveModel())
        cluster["collective"] = CollectiveModel("tree", base.alpha_s, base.beta_s_per_byte)
    _refuse_unhonoured(sw, SIM_HONOURS, "a simulated job")
    cluster["modes"] = modes_for(sw, cluster.get("modes", ModeConfig()))
    if not sw.elastic_membership:
        cluster["min_workers"] = workers  # a fixed world: every step needs every worker
    sc = Scenario(workers, seed, detector=detector_for(sw),
                  collective_timeout_s=collective_timeout_for(sw, collective_timeout_s),
                  max_virtual_s=deadline_s, **cluster)
    if faults is not None:
        sc = faults(sc)
    res = sc.run_until(step=steps)
    return JobRun(res.ok, res.reason, res.events, list(res.summary["faults"]), float(res.summary["wall_s"]), True,
                  res.summary)


def plan_of(faults: Faults | None, workers: int) -> FaultPlan:
    return EMPTY_PLAN if faults is None else faults(Scenario(workers)).plan


def run_real(run_dir: Path, workers: int, steps: int, faults: Faults | None = None, *, seed: int = 0,
             sw: LabSwitches = ALL_ON, modes: ModeConfig = ModeConfig(), min_step_s: float = 0.0,
             max_wall_s: float = 120.0, stall_timeout_s: float = 20.0, overlap: bool = True) -> JobRun:
    """A real job: the bundled model on ``workers`` local processes (a crashed one is restarted).
    ``overlap=False``: the gradients are all-reduced after the backward pass, not during it
    (``charlm_train --no-overlap``, i.e. ``job.track(..., overlap=False)``)."""
    from phalanx.runtime.launcher import LaunchConfig, launch, python_argv
    from phalanx.runtime.run_dir import claim_run_dir

    _refuse_unhonoured(sw, REAL_HONOURS, "a real job")
    plan = plan_of(faults, workers)
    plan.require_supported("real")
    claim_run_dir(run_dir)
    argv = python_argv("phalanx.workload.charlm_train", "--steps", str(steps), "--seed", str(seed),
                       "--global-batch-size", "32", "--min-step-s", str(min_step_s),
                       *(() if overlap else ("--no-overlap",)))
    res = launch(LaunchConfig(argv=argv, workers=workers, run_dir=run_dir, fault_plan=plan, restart_failed=True,
                              total_steps=steps, data_seed=seed, show_progress=False, modes=modes_for(sw, modes),
                              detector=detector_for(sw), collective_timeout_s=collective_timeout_for(sw),
                              min_workers=1 if sw.elastic_membership else workers,
                              max_wall_s=max_wall_s, stall_timeout_s=stall_timeout_s))
    return JobRun(res.ok, res.reason, res.events, res.faults, res.wall_s, False,
                  {"steps_retried": res.steps_retried, "control_plane": res.transport})
