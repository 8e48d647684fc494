"""Who a network fault hits: pure functions shared by real runs and the simulator.

A partition gives every worker a side; side 0 is the coordinator's. ``isolate = W`` cuts W off,
``groups = [[...], [...]]`` lists the sides (the coordinator stays with the first group), and with
neither the default rule cuts off a minority: the workers above the middle (``N // 2 + 1 ..``),
with nobody. A link fault hits every link, the links of ``workers`` (or of ``worker``), or the one
link of a ``pair``. The plan parser has checked the shapes and ``FaultPlan.validate_workers`` the
indices, so these only resolve.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.faults.plan import Fault


def partition_sides(f: Fault, num_workers: int) -> dict[str, int]:
    """Worker id -> side for a partition fault (workers not listed are on side 0)."""
    isolate, groups = f.param("isolate"), f.param("groups")
    if isolate is not None:
        return {f"w{int(isolate)}": 1}
    if groups:
        return {f"w{int(i)}": side for side, group in enumerate(groups) for i in group}
    return {f"w{i}": 1 for i in range(num_workers // 2 + 1, num_workers)}


def cut_off(sides: dict[str, int], num_workers: int) -> tuple[str, ...]:
    """The workers not on the coordinator's side, in worker order."""
    return tuple(f"w{i}" for i in range(num_workers) if sides.get(f"w{i}", 0) != 0)


def sides_as_groups(sides: dict[str, int], num_workers: int) -> list[list[str]]:
    """[[side 0 workers], [side 1 workers], ...] of the workers the fault places (a worker on no
    list is on side 0, with the coordinator)."""
    n_sides = max(sides.values(), default=0) + 1
    return [[f"w{i}" for i in range(num_workers) if sides.get(f"w{i}") == side] for side in range(n_sides)]


@dataclass(frozen=True)
class LinkScope:
    workers: tuple[str, ...] = ()  # every link of these workers
    pair: tuple[str, ...] = ()  # the one link between these two
    # neither: every link of every worker

    @property
    def everywhere(self) -> bool:
        return not self.workers and not self.pair


def link_scope(f: Fault) -> LinkScope:
    pair, workers = f.param("pair"), f.param("workers")
    if pair is not None:
        return LinkScope(pair=tuple(f"w{int(i)}" for i in pair))
    if workers is None and f.worker is not None:
        workers = [f.worker]
    if workers:
        return LinkScope(workers=tuple(f"w{i}" for i in sorted({int(i) for i in workers})))
    return LinkScope()
