"""Random fault schedules over many seeds, with invariant checks, a liveness bound, replay commands
and shrinking of a failing schedule to a minimal one that still fails."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from phalanx.core.modes import ModeConfig
from phalanx.faults.plan import parse_fault_plan
from phalanx.sim.cluster import Cluster, SimResult
from phalanx.sim.scenario import faults_toml as schedule_toml  # one writer of the plan format

KINDS = ("kill", "freeze", "hang", "partition", "loss", "latency", "straggler", "gil_hang", "duplicate", "reorder",
         "coordinator_kill", "join")
_LINK_KINDS = ("loss", "latency", "duplicate", "reorder")


def random_schedule(seed: int, workers: int, steps: int, max_faults: int = 4) -> list[dict[str, object]]:
    """A seeded list of faults; every fault ends (timed, or a kill with restart), so the cluster must
    make progress again afterwards: that is the liveness phase."""
    rng = random.Random(f"sweep:{seed}")
    faults: list[dict[str, object]] = []
    joins_at: dict[int, int] = {}  # join worker -> its step: the plan parser wants its other faults later
    for _ in range(rng.randint(1, max_faults)):
        kind = rng.choice(KINDS)
        f: dict[str, object] = {"kind": kind, "at_step": rng.randint(1, max(1, steps - 5))}
        if kind == "join":
            # a worker no fault has named yet; at least one worker is there from the start
            named = set(joins_at) | {int(str(g["worker"])) for g in faults if "worker" in g}
            free = [w for w in range(workers) if w not in named]
            if not free or len(joins_at) >= workers - 1:
                continue
            f["worker"] = rng.choice(free)
            joins_at[int(str(f["worker"]))] = int(str(f["at_step"]))
        if kind in ("kill", "freeze", "hang", "straggler", "gil_hang"):
            w = rng.randrange(workers)
            f["worker"] = w
            if w in joins_at:
                f["at_step"] = max(int(str(f["at_step"])), joins_at[w] + 1)
        if kind in ("freeze", "hang", "gil_hang", "partition", "straggler", *_LINK_KINDS):
            f["for_s"] = round(rng.uniform(0.3, 4.0), 2)
        if kind in _LINK_KINDS and workers > 1:
            scope = rng.randrange(3)  # every link, one worker's links, or one pair's link
            if scope == 1:
                f["workers"] = [rng.randrange(workers)]
            elif scope == 2:
                f["pair"] = rng.sample(range(workers), 2)
        if kind == "partition":
            if rng.random() < 0.5:
                f["isolate"] = rng.randrange(workers)
            else:
                cut = rng.randint(1, max(1, workers // 2))
                f["groups"] = [list(range(cut, workers)), list(range(cut))]  # minority cut from the coordinator
        elif kind == "loss":
            f["probability"] = round(rng.uniform(0.005, 0.05), 3)
        elif kind == "latency":
            f["mean_ms"] = round(rng.uniform(1, 30), 1)
            f["jitter_ms"] = round(rng.uniform(0, 10), 1)
        elif kind == "straggler":
            f["factor"] = round(rng.uniform(1.5, 4.0), 2)
        elif kind == "duplicate":
            f["probability"] = round(rng.uniform(0.01, 0.3), 3)
        elif kind == "reorder":
            f["probability"] = round(rng.uniform(0.01, 0.3), 3)
            f["delay_ms"] = round(rng.uniform(0.5, 20), 1)
        elif kind == "coordinator_kill":
            f["restart_after_s"] = round(rng.uniform(0.2, 3.0), 2)
        faults.append(f)
    return faults


@dataclass
class SeedOutcome:
    seed: int
    ok: bool
    reason: str
    faults: list[dict[str, object]]
    result: SimResult | None = None
    shrunk: list[dict[str, object]] | None = None
    plan_path: str = ""
    expected_stop: bool = False  # ok because it stopped as it should (see expected_stop())


@dataclass(frozen=True)
class SweepShape:
    """What every seed of a sweep runs besides its schedule: the mode and durable checkpoints."""

    modes: ModeConfig = ModeConfig()
    checkpoint_every_steps: int = 0


def run_schedule(seed: int, workers: int, steps: int, faults: list[dict[str, object]],
                 shape: SweepShape = SweepShape()) -> SimResult:
    plan = parse_fault_plan(schedule_toml(faults), f"<sweep seed {seed}>")
    return Cluster(workers=workers, steps=steps, seed=seed, plan=plan, max_virtual_s=steps * 5.0 + 300,
                   modes=shape.modes, checkpoint_every_steps=shape.checkpoint_every_steps).run()


def expected_stop(res: SimResult) -> bool:
    """A run that stopped only because every holder of the newest state was killed (the schedule
    broke the liveness phase's premise), with every safety invariant held and the coordinator
    stalled for exactly that reason: the right outcome, not a failure."""
    return (not res.ok and not res.violations and res.summary.get("all_state_lost") is not None
            and "no connected worker holds step" in res.reason)


def shrink(seed: int, workers: int, steps: int, faults: list[dict[str, object]],
           still_fails: Callable[[list[dict[str, object]]], bool] | None = None,
           shape: SweepShape = SweepShape()) -> list[dict[str, object]]:
    """Greedy delta debugging: drop one fault at a time while the run still fails."""
    fails = still_fails or (lambda fs: not run_schedule(seed, workers, steps, fs, shape).ok)
    current = list(faults)
    changed = True
    while changed and len(current) > 1:
        changed = False
        for i in range(len(current)):
            trial = current[:i] + current[i + 1 :]
            if fails(trial):
                current, changed = trial, True
                break
    return current


def sweep(seeds: range, workers: int, steps: int, out_dir: Path,
          on_seed: Callable[[SeedOutcome], None] | None = None, max_faults: int = 4,
          shape: SweepShape = SweepShape()) -> list[SeedOutcome]:
    outcomes = []
    for seed in seeds:
        faults = random_schedule(seed, workers, steps, max_faults)
        res = run_schedule(seed, workers, steps, faults, shape)
        stopped = expected_stop(res)
        o = SeedOutcome(seed, res.ok or stopped, res.reason, faults, res, expected_stop=stopped)
        if stopped:
            lost = res.summary["all_state_lost"]
            o.reason = (f"expected stop: at t={lost['t']}s every process holding step {lost['step']} had been killed, "
                        "and without a checkpoint nobody can go on (safety invariants held)")
        if not o.ok:
            o.shrunk = shrink(seed, workers, steps, faults, shape=shape)
            out_dir.mkdir(parents=True, exist_ok=True)
            path = out_dir / f"seed-{seed}.toml"
            path.write_text(f"# sweep seed {seed}: {res.reason}\n" + schedule_toml(o.shrunk))
            o.plan_path = str(path)
        outcomes.append(o)
        if on_seed:
            on_seed(o)
    return outcomes


def replay_command(o: SeedOutcome, workers: int, steps: int) -> str:
    return f"phalanx sim run --workers {workers} --steps {steps} --seed {o.seed} --fault-plan {o.plan_path}"

