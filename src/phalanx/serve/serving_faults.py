"""Serving fault plans: the training TOML vocabulary (``faults/plan.py`` parses it), narrowed to what
a replica can suffer. ``worker = i`` names replica ``r<i>``; timing is ``at_s`` (serving has no steps).
A kind serving does not support is refused with the plan's file and line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from phalanx.core.errors import FaultPlanError
from phalanx.faults.plan import Fault, FaultKind, load_fault_plan

SERVING_KINDS = {FaultKind.KILL, FaultKind.FREEZE, FaultKind.HANG, FaultKind.STRAGGLER, FaultKind.LATENCY,
                 FaultKind.LOSS, FaultKind.PARTITION}


@dataclass(frozen=True)
class ServingFault:
    kind: str
    replica: int
    at_s: float
    for_s: float | None
    factor: float
    line: int


def serving_faults(path: str, faults: tuple[Fault, ...]) -> list[ServingFault]:
    out = []
    for f in faults:
        if f.kind not in SERVING_KINDS:
            names = ", ".join(sorted(k.value for k in SERVING_KINDS))
            raise FaultPlanError(path, f.line, f"fault kind '{f.kind.value}' is not supported when serving "
                                               f"(supported: {names})")
        if f.worker is None:
            raise FaultPlanError(path, f.line, "a serving fault needs 'worker = <replica index>'")
        if f.at_step is not None:
            raise FaultPlanError(path, f.line, "serving has no steps; use 'at_s' instead of 'at_step'")
        out.append(ServingFault(f.kind.value, f.worker, f.at_s or 0.0, f.for_s, f.factor or 1.0, f.line))
    return out


def load_serving_faults(path: str | Path) -> list[ServingFault]:
    plan = load_fault_plan(path)
    return serving_faults(str(path), plan.faults)
