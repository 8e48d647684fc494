"""Serving fault plans: the training TOML vocabulary (``faults/plan.py`` parses it), narrowed to what
a replica can suffer. ``worker = i`` names replica ``r<i>`` (``isolate = i`` for a partition,
``workers = [..]`` for latency and loss); timing is ``at_s`` (serving has no steps). A kind serving
does not support, or a replica the run does not have, is refused with the plan's file and line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    params: tuple[tuple[str, Any], ...] = ()  # latency: mean_ms, jitter_ms; loss: probability
    restart: bool = False  # kill: start a fresh replica on the same port (the vocabulary's default is true)


_EDGE_PARAMS = ("mean_ms", "jitter_ms", "probability")


def _targets(path: str, f: Fault) -> list[int]:
    if f.kind is FaultKind.PARTITION:
        if f.param("groups") is not None or f.param("one_way") is not None:
            raise FaultPlanError(path, f.line, "a serving partition cuts one replica off: use 'isolate = <replica>'")
        who = f.param("isolate", f.worker)
        return [] if who is None else [int(who)]
    if f.kind in (FaultKind.LATENCY, FaultKind.LOSS):
        if f.param("pair") is not None:
            raise FaultPlanError(path, f.line, "serving has no worker pairs: name replicas with 'workers = [..]'")
        return [int(i) for i in f.param("workers") or ()] or ([f.worker] if f.worker is not None else [])
    return [] if f.worker is None else [f.worker]


def serving_faults(path: str, faults: tuple[Fault, ...], replicas: int | None = None) -> list[ServingFault]:
    out = []
    for f in faults:
        if f.kind not in SERVING_KINDS:
            names = ", ".join(sorted(k.value for k in SERVING_KINDS))
            raise FaultPlanError(path, f.line, f"fault kind '{f.kind.value}' is not supported when serving "
                                               f"(supported: {names})")
        if f.at_step is not None:
            raise FaultPlanError(path, f.line, "serving has no steps; use 'at_s' instead of 'at_step'")
        targets = _targets(path, f)
        if not targets:
            raise FaultPlanError(path, f.line, "a serving fault needs the replica it hits: 'worker = <replica index>'"
                                               " ('isolate' for a partition, 'workers' for latency and loss)")
        params = tuple((k, f.param(k)) for k in _EDGE_PARAMS if f.param(k) is not None)
        for r in targets:
            if replicas is not None and not 0 <= r < replicas:
                raise FaultPlanError(path, f.line, f"replica {r} does not exist: this run has {replicas} "
                                                   f"(indices 0..{replicas - 1})")
            out.append(ServingFault(f.kind.value, r, f.at_s or 0.0, f.for_s, f.factor or 1.0, f.line, params,
                                    f.kind is FaultKind.KILL and f.restart))
    return out


def load_serving_faults(path: str | Path, replicas: int | None = None) -> list[ServingFault]:
    plan = load_fault_plan(path)
    return serving_faults(str(path), plan.faults, replicas)
