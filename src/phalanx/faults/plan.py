"""Fault plans: TOML files of timed faults. Errors name the file, the line and the problem.

Every value is checked here, before a run starts: types, ranges (finite, within sane bounds) and
the shape of every target key (``groups``, ``isolate``, ``workers``, ``pair``); worker indices are
checked against the run's size by :meth:`FaultPlan.validate_workers`. When a fault fires is
defined once, in :mod:`phalanx.faults.timeline` (``at_s`` counts from the first committed step).
"""

from __future__ import annotations

import math
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


# Upper bounds: a value past these is a typo, not a plan (and NaN or inf never are).
_MAX: dict[str, float] = {
    "at_step": 10**9, "at_s": 10**6, "worker": 65_535, "for_s": 86_400.0, "factor": 1_000.0, "mean_ms": 600_000.0,
    "jitter_ms": 600_000.0, "delay_ms": 600_000.0, "bytes_per_s": 1e13, "restart_after_s": 3_600.0,
}
DISTRIBUTIONS = ("constant", "normal", "pareto")


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

    def named_workers(self) -> list[tuple[str, int]]:
        """(key, worker index) of every worker this fault names."""
        out = [("worker", self.worker)] if self.worker is not None else []
        if self.param("isolate") is not None:
            out.append(("isolate", int(self.param("isolate"))))
        for key in ("workers", "pair"):
            out += [(key, int(i)) for i in self.param(key) or ()]
        out += [("groups", int(i)) for g in self.param("groups") or () for i in g]
        return out

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
        """Every worker a fault names (``worker``, ``isolate``, ``groups``, ``workers``, ``pair``) exists."""
        for f in self.faults:
            for key, index in f.named_workers():
                if not 0 <= index < num_workers:
                    raise FaultPlanError(self.path, f.line, f"fault #{f.index + 1} ({f.kind.value}): worker {index} "
                                         f"(in '{key}') does not exist in a run of {num_workers} workers "
                                         f"(0..{num_workers - 1})")
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
        if ok and not math.isfinite(v):
            raise err(key, f"'{key}' must be a finite number, got {v!r}")
        if not ok or v < minimum or (strict and v <= minimum):
            rel = ">" if strict else ">="
            raise err(key, f"'{key}' must be {'an integer' if integer else 'a number'} {rel} {minimum:g}, got {v!r}")
        if v > _MAX.get(key, math.inf):
            raise err(key, f"'{key}' = {v!r} is beyond the largest sensible value, {_MAX[key]:g}")
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
    params += _targets(e, err)
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


def _indices(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= _MAX["worker"]
                                       for i in v)


def _targets(e: dict[str, Any], err: Any) -> list[tuple[str, Any]]:
    """The target keys, their shapes checked (indices against the run's size later)."""
    out: list[tuple[str, Any]] = []
    if "groups" in e and "isolate" in e:
        raise err("isolate", "give 'groups' (the sides) or 'isolate' (one worker), not both")
    if "workers" in e and "pair" in e:
        raise err("pair", "give 'workers' (their links) or 'pair' (one link), not both")
    if "groups" in e:
        g = e["groups"]
        if not isinstance(g, list) or len(g) < 2 or not all(_indices(x) and x for x in g):
            raise err("groups", f"'groups' must be a list of at least two non-empty lists of worker indices, "
                                f"e.g. [[0, 1], [2]], got {g!r}")
        flat = [i for x in g for i in x]
        if len(flat) != len(set(flat)):
            dup = sorted({i for i in flat if flat.count(i) > 1})
            raise err("groups", f"worker {dup[0]} is in two groups")
        out.append(("groups", tuple(tuple(x) for x in g)))
    if "isolate" in e:
        v = e["isolate"]
        if not _indices([v]):
            raise err("isolate", f"'isolate' must be one worker index, got {v!r}")
        out.append(("isolate", v))
    if "workers" in e:
        v = e["workers"]
        if not _indices(v) or not v or len(v) != len(set(v)):
            raise err("workers", f"'workers' must be a non-empty list of distinct worker indices, got {v!r}")
        out.append(("workers", tuple(v)))
    if "pair" in e:
        v = e["pair"]
        if not _indices(v) or len(v) != 2 or v[0] == v[1]:
            raise err("pair", f"'pair' must name two different workers, e.g. [0, 1], got {v!r}")
        out.append(("pair", tuple(v)))
    if "one_way" in e:
        if not isinstance(e["one_way"], bool):
            raise err("one_way", f"'one_way' must be true or false, got {e['one_way']!r}")
        out.append(("one_way", e["one_way"]))
    if "distribution" in e:
        if e["distribution"] not in DISTRIBUTIONS:
            raise err("distribution", f"'distribution' must be one of {', '.join(DISTRIBUTIONS)}, "
                                      f"got {e['distribution']!r}")
        out.append(("distribution", e["distribution"]))
    return out


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
