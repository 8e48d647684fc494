"""Run one experiment (or all of them) inside a lab session and write its report."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from phalanx.lab.context import LabContext
from phalanx.lab.outcome import Outcome, default_dir, write_outcome
from phalanx.lab.registry import EXPERIMENTS, Experiment, find
from phalanx.lab.switches import lab_session
from phalanx.runtime.run_dir import claim_run_dir


@dataclass(frozen=True)
class LabRequest:
    sim: bool = False
    real: bool = False  # force real processes where the experiment defaults to the simulator
    quick: bool = False
    seed: int = 0
    out: Path | None = None  # one experiment: its folder; all: the parent of every experiment's folder


def run_one(exp: Experiment, req: LabRequest, out_dir: Path, say: Callable[[str], None]) -> Outcome:
    sim = req.sim or ((exp.sim_by_default or (exp.quick_sim and req.quick)) and not req.real)
    ctx = LabContext(out_dir=out_dir, sim=sim, quick=req.quick, seed=req.seed, say=say)
    t0 = time.monotonic()
    claim_run_dir(out_dir)  # a new or empty folder, or one phalanx made: never someone else's
    with lab_session():  # the only place mechanism switches may be off
        outcome = exp.runner()(ctx)
    outcome.wall_s = time.monotonic() - t0
    write_outcome(outcome, out_dir)
    return outcome


def could_not_run(exp: Experiment, e: Exception) -> Outcome:
    why = f"{type(e).__name__}: {e}"
    return Outcome(exp.name, exp.summary, "did not run", ["error"], [[why]], f"The experiment could not run: {why}",
                   "the experiment ran", False, {"error": why})


def run_named(name: str, req: LabRequest, say: Callable[[str], None]) -> tuple[Outcome, Path]:
    exp = find(name)
    out_dir = req.out or default_dir(name)
    return run_one(exp, req, out_dir, say), out_dir


def run_all(req: LabRequest, say: Callable[[str], None],
            on_done: Callable[[Outcome, Path], None]) -> list[tuple[Outcome, Path]]:
    parent = req.out or default_dir("all")
    done = []
    for exp in EXPERIMENTS:
        say(f"[{exp.name}]")
        out_dir = parent / exp.name
        try:
            o = run_one(exp, req, out_dir, say)
        except Exception as e:  # one broken experiment is reported; the others still run
            o = could_not_run(exp, e)
            write_outcome(o, out_dir)
        on_done(o, out_dir)
        done.append((o, out_dir))
    return done
