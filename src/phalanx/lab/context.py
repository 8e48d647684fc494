"""What an experiment is given: where to write, real or simulated, quick or full, a progress line."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


def _quiet(msg: str) -> None:
    pass


@dataclass
class LabContext:
    out_dir: Path
    sim: bool = False  # the simulator instead of real local processes
    quick: bool = False  # the short form (`phalanx lab all --quick`, the tests)
    seed: int = 0
    say: Callable[[str], None] = field(default=_quiet)  # one progress line ("running crash ...")

    def sub(self, name: str) -> Path:
        """A folder for one real job of this experiment."""
        return self.out_dir / "jobs" / name

    @property
    def where(self) -> str:
        return "the simulator (virtual time)" if self.sim else "real local worker processes"
