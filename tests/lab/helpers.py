"""Run a lab experiment's quick form the way `phalanx lab NAME --quick` does, into tmp_path."""

from __future__ import annotations

from pathlib import Path

from phalanx.lab.outcome import Outcome
from phalanx.lab.registry import find
from phalanx.lab.runner import LabRequest, run_one


def run_quick(name: str, out: Path, sim: bool = True) -> Outcome:
    return run_one(find(name), LabRequest(sim=sim, real=not sim, quick=True), out / name, lambda _: None)
