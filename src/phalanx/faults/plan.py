"""Fault plans: TOML files of timed faults. Errors name the file, the line and the problem."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from phalanx.core.errors import FaultPlanError


class FaultKind(str, Enum):
    KILL = "kill"
    FREEZE = "freeze"
    GIL_HANG = "gil_hang"
    HANG = "hang"
    STRAGGLER = "straggler"
    PARTITION = "partition"
    LATENCY = "latency"
    LOSS = "loss"
    BANDWIDTH = "bandwidth"
    DUPLICATE = "duplicate"  # simulator only: TCP hides it, it costs bandwidth
    REORDER = "reorder"  # simulator only: TCP hides it, it costs head-of-line delay
    COORDINATOR_KILL = "coordinator_kill"
    JOIN = "join"  # the worker is not there at the start; it starts, fresh, at the trigger and heals


WORKER_KINDS = frozenset({FaultKind.KILL, FaultKind.FREEZE, FaultKind.GIL_HANG, FaultKind.HANG, FaultKind.STRAGGLER})
NETWORK_KINDS = frozenset({FaultKind.PARTITION, FaultKind.LATENCY, FaultKind.LOSS, FaultKind.BANDWIDTH})
SUPPORTED: dict[str, frozenset[FaultKind]] = {
    "real": WORKER_KINDS | NETWORK_KINDS | {FaultKind.COORDINATOR_KILL, FaultKind.JOIN},  # network kinds act
    # at the worker's seams (train.network_faults); coordinator_kill is carried out by the launcher
    # (runtime.launcher_faults); a join worker is started by the fault injector, not at the start
    "sim": frozenset(FaultKind),
}
# key -> (required for kinds, allowed for kinds)
_COMMON = {"kind", "at_step", "at_s", "worker", "note"}
_KEYS: dict[FaultKind, tuple[set[str], set[str]]] = {
    FaultKind.KILL: ({"worker"}, {"restart", "phase"}),
    FaultKind.FREEZE: ({"worker", "for_s"}, set()),
    FaultKind.GIL_HANG: ({"worker", "for_s"}, set()),
    FaultKind.HANG: ({"worker", "for_s"}, set()),
    FaultKind.STRAGGLER: ({"worker", "factor"}, {"for_s"}),
    FaultKind.PARTITION: ({"for_s"}, {"groups", "isolate", "one_way"}),
    FaultKind.LATENCY: ({"mean_ms"}, {"jitter_ms", "distribution", "for_s", "workers", "pair"}),
    FaultKind.LOSS: ({"probability"}, {"for_s", "workers", "pair"}),
    FaultKind.BANDWIDTH: ({"bytes_per_s"}, {"for_s", "workers", "pair"}),
    FaultKind.DUPLICATE: ({"probability"}, {"for_s", "workers", "pair"}),
    FaultKind.REORDER: ({"probability", "delay_ms"}, {"for_s", "workers", "pair"}),
    FaultKind.COORDINATOR_KILL: (set(), {"restart_after_s"}),
    FaultKind.JOIN: ({"worker"}, set()),
}


@dataclass(frozen=True)
class Fault:
    index: int
    kind: FaultKind
    line: int
    at_step: int | None = None
    at_s: float | None = None
    worker: int | None = None
    for_s: float | None = None
    restart: bool = True
    phase: str = "step"
    factor: float | None = None
    params: tuple[tuple[str, Any], ...] = ()

    def param(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)

    def describe(self) -> str:
        who = f" worker {self.worker}" if self.worker is not None else ""
        dur = f" for {self.for_s:g} s" if self.for_s else ""
        when = f"at step {self.at_step}" if self.at_step is not None else f"at {self.at_s:g} s"
        extra = f" (x{self.factor:g})" if self.factor else (" mid-allreduce" if self.phase == "allreduce" else "")
        return f"{self.kind.value}{who}{dur}{extra} {when}"


@dataclass(frozen=True)
class FaultPlan:
    path: str
    name: str
    faults: tuple[Fault, ...]

    @property
    def joiners(self) -> frozenset[int]:
        """Workers that are not there at the start: each starts at its ``join`` fault's trigger."""
        return frozenset(f.worker for f in self.faults if f.kind is FaultKind.JOIN and f.worker is not None)

    def validate_workers(self, num_workers: int) -> None:
        for f in self.faults:
            if f.worker is not None and not 0 <= f.worker < num_workers:
                raise FaultPlanError(self.path, f.line, f"fault #{f.index + 1} ({f.kind.value}): worker {f.worker} "
                                     f"does not exist in a run of {num_workers} workers (0..{num_workers - 1})")
        if self.joiners and len(self.joiners) >= num_workers:
            last = [f for f in self.faults if f.kind is FaultKind.JOIN][-1]
            raise FaultPlanError(self.path, last.line, f"fault #{last.index + 1} (join): every one of the "
                                 f"{num_workers} workers joins later, so nobody starts the job; leave at least "
                                 "one worker without a join")

    def require_supported(self, side: str) -> None:
        for f in self.faults:
            if f.kind not in SUPPORTED[side]:
                names = ", ".join(sorted(k.value for k in SUPPORTED[side]))
                raise FaultPlanError(self.path, f.line, f"fault kind '{f.kind.value}' is not supported by the "
                                     f"{'real runtime' if side == 'real' else 'simulator'} yet (supported: {names})")


EMPTY_PLAN = FaultPlan("<none>", "no faults", ())


def default_plan_path() -> Path:
    return Path(__file__).parent / "plans" / "default.toml"


def load_fault_plan(path: str | Path) -> FaultPlan:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise FaultPlanError(str(p), None, f"cannot read the fault plan ({e.strerror})") from e
    return parse_fault_plan(text, str(p))


def _block_lines(text: str) -> list[tuple[int, dict[str, int]]]:
    """(header line, {key: line}) for each [[fault]] block, since tomllib gives no positions."""
    blocks: list[tuple[int, dict[str, int]]] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if re.fullmatch(r"\[\[\s*fault\s*\]\]", line):
            blocks.append((n, {}))
        elif blocks and (m := re.match(r"([A-Za-z_][A-Za-z0-9_]*)\s*=", line)):
            blocks[-1][1].setdefault(m.group(1), n)
    return blocks


def parse_fault_plan(text: str, path: str = "<string>") -> FaultPlan:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"at line (\d+)", str(e))
        raise FaultPlanError(path, int(m.group(1)) if m else None, f"not valid TOML: {e}") from e
    unknown = set(doc) - {"fault", "name", "description"}
    if unknown:
        raise FaultPlanError(path, None, f"unknown top-level keys {sorted(unknown)}; faults go in [[fault]] tables")
    entries = doc.get("fault", [])
    if not isinstance(entries, list):
        raise FaultPlanError(path, None, "'fault' must be an array of tables: write [[fault]] before each fault")
    blocks = _block_lines(text)
    faults = tuple(_fault(i, e, blocks[i] if i < len(blocks) else (None, {}), path) for i, e in enumerate(entries))
    _check_joins(faults, path)
    return FaultPlan(path, str(doc.get("name", Path(path).stem)), faults)


def _fault(i: int, e: dict[str, Any], block: tuple[int | None, dict[str, int]], path: str) -> Fault:
    header, key_lines = block

    def err(key: str | None, problem: str) -> FaultPlanError:
        line = key_lines.get(key, header) if key else header
        kind = e.get("kind", "?")
        return FaultPlanError(path, line, f"fault #{i + 1} ({kind}): {problem}")

    kind_s = e.get("kind")
    try:
        kind = FaultKind(kind_s)
    except ValueError:
        raise err("kind" if "kind" in e else None, f"'kind' must be one of {', '.join(k.value for k in FaultKind)}, "
                  f"got {kind_s!r}") from None
    required, optional = _KEYS[kind]
    for k in sorted(set(e) - _COMMON - required - optional):
        raise err(k, f"unknown key '{k}' for kind {kind.value}")
    for k in sorted(required - set(e)):
        raise err(None, f"missing required key '{k}'")
    if ("at_step" in e) == ("at_s" in e):
        raise err(None, "give exactly one trigger: at_step = N or at_s = SECONDS")

    def num(key: str, integer: bool = False, minimum: float = 0.0, strict: bool = False) -> Any:
        if key not in e:
            return None
        v = e[key]
        ok = not isinstance(v, bool) and (isinstance(v, int) if integer else isinstance(v, (int, float)))
        if not ok or v < minimum or (strict and v <= minimum):
            rel = ">" if strict else ">="
            raise err(key, f"'{key}' must be {'an integer' if integer else 'a number'} {rel} {minimum:g}, got {v!r}")
        return v

    params = []
    for k in ("mean_ms", "jitter_ms", "delay_ms", "bytes_per_s", "restart_after_s"):
        if k in e:
            params.append((k, float(num(k, strict=(k == "bytes_per_s")))))
    if "probability" in e:
        p = num("probability")
        if p >= 1:
            raise err("probability", f"'probability' must be in [0, 1), got {p}")
        params.append(("probability", float(p)))
    for k in ("groups", "isolate", "one_way", "workers", "pair", "distribution"):
        if k in e:
            params.append((k, e[k]))
    phase = e.get("phase", "step")
    if phase not in ("step", "allreduce"):
        raise err("phase", f"'phase' must be \"step\" or \"allreduce\", got {phase!r}")
    restart = e.get("restart", True)
    if not isinstance(restart, bool):
        raise err("restart", f"'restart' must be true or false, got {restart!r}")
    factor = num("factor", minimum=1.0)
    return Fault(index=i, kind=kind, line=header or 0, at_step=num("at_step", integer=True),
                 at_s=None if "at_s" not in e else float(num("at_s")), worker=num("worker", integer=True),
                 for_s=None if "for_s" not in e else float(num("for_s", strict=True)), restart=restart, phase=phase,
                 factor=None if factor is None else float(factor), params=tuple(params))


def _check_joins(faults: tuple[Fault, ...], path: str) -> None:
    """A worker joins at most once, and nothing can happen to it before it is there: every other
    fault naming a join worker must trigger strictly after its join, on the same kind of trigger
    (how a step number and a time compare is only known once the run is going)."""
    joins: dict[int, Fault] = {}
    for f in faults:
        if f.kind is FaultKind.JOIN and f.worker is not None:
            if f.worker in joins:
                first = joins[f.worker]
                raise FaultPlanError(path, f.line, f"fault #{f.index + 1} (join): worker {f.worker} already joins "
                                     f"in fault #{first.index + 1} (line {first.line}); a worker joins only once")
            joins[f.worker] = f
    for f in faults:
        j = joins.get(f.worker) if f.worker is not None and f.kind is not FaultKind.JOIN else None
        if j is None:
            continue
        if j.at_step is not None:
            later, joins_at = f.at_step is not None and f.at_step > j.at_step, ("at_step", f"{j.at_step}")
        else:
            assert j.at_s is not None
            later, joins_at = f.at_s is not None and f.at_s > j.at_s, ("at_s", f"{j.at_s:g}")
        if not later:
            key, value = joins_at
            raise FaultPlanError(path, f.line, f"fault #{f.index + 1} ({f.kind.value}): worker {f.worker} is not "
                                 f"there yet: it joins at {key} = {value} (fault #{j.index + 1}, line {j.line}); "
                                 f"trigger this fault after the join ({key} > {value})")
