"""Mechanism switches that exist only for the lab.

``LabSwitches`` names each mechanism an experiment can turn off. Every field defaults to on; a
``LabSwitches`` with any mechanism off can only be built inside :func:`lab_session` (which only
``phalanx lab`` and the lab's tests open): anywhere else it raises ``ConfigError``, so no production
path can run with, say, its deadlines switched off. The session gate lives in
``sim/lab_session.py``, below the lab, so that the simulator refuses its own lab-only field
(``Cluster.restart_fencing_floor``) the same way.

A switch never edits protocol code: it maps to existing configuration (detector and collective
deadlines, consistency mode, the collective algorithm of the simulator) or to a sandbox the
experiment builds for itself (authentication, run-folder ownership). ``describe()`` says which.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from phalanx.core.errors import ConfigError
from phalanx.sim.lab_session import LAB_ENV, in_lab_session, lab_session

__all__ = ["ALL_ON", "LAB_ENV", "NEVER_S", "OFF_MEANS", "LabSwitches", "in_lab_session", "lab_session", "off"]

# A deadline that never fires within any lab run (its own wall/virtual deadline bounds the run).
NEVER_S = 86_400.0

# switch -> what "off" means, in the words the reports use
OFF_MEANS = {
    "deadlines": "heartbeat, progress and collective timeouts set to a day: nothing is ever declared dead",
    "progress_detector": "progress timeout set to a day: a worker that heartbeats is never suspected",
    "collective_deadline": "all-reduce deadline set to a day: members wait for a missing peer forever",
    "fencing": "a restarted coordinator starts without its predecessor's durable floor of quorum ids and steps",
    "authentication": "frames verified by a receiver that holds no cluster key (sandbox)",
    "timeout_margin": "heartbeat timeout sized for a local link (interval + 50 ms = 0.15 s) instead of 0.6 s",
    "bandwidth_optimal_allreduce": "tree all-reduce (log p full copies) instead of the ring (2 x 1/p)",
    "infrequent_sync": "strict: an all-reduce every step instead of local-sgd's merge every 10 steps",
    "elastic_membership": "the quorum needs every worker (min_workers = N): a departed worker stops the job",
    "adaptive_shares": "strict mode's equal shares instead of available mode's speed-sized shares",
    "run_dir_ownership": "a run folder is adopted without the .phalanx-run ownership check (sandbox)",
}


@dataclass(frozen=True)
class LabSwitches:
    deadlines: bool = True
    progress_detector: bool = True
    collective_deadline: bool = True
    fencing: bool = True
    authentication: bool = True
    timeout_margin: bool = True
    bandwidth_optimal_allreduce: bool = True
    infrequent_sync: bool = True
    elastic_membership: bool = True
    adaptive_shares: bool = True
    run_dir_ownership: bool = True

    def __post_init__(self) -> None:
        off = self.off()
        if off and not in_lab_session():
            raise ConfigError(f"mechanism switch(es) {', '.join(off)} can only be turned off inside `phalanx lab` "
                              "(they exist to demonstrate failures); remove them from this configuration")

    def off(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if not getattr(self, f.name)]

    def describe(self) -> str:
        off = self.off()
        return "all mechanisms on" if not off else "; ".join(f"{k} OFF ({OFF_MEANS[k]})" for k in off)


ALL_ON = LabSwitches()


def off(*names: str) -> LabSwitches:
    """Switches with the named mechanisms off (inside a lab session only)."""
    unknown = [n for n in names if n not in OFF_MEANS]
    if unknown:
        raise ConfigError(f"unknown lab switch(es) {unknown}; known: {sorted(OFF_MEANS)}")
    return LabSwitches(**{n: False for n in names})
