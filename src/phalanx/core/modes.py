"""Consistency modes: the CAP trade-off, made an explicit choice of the run.

- ``strict``: every step is the full global batch, split evenly over the current quorum; a failure
  rolls the step back and retries it; the result equals the fault-free single-process run.
- ``available``: a step goes ahead with the members that are there by ``deadline_s`` (at least
  ``min_workers``), and each member's share of the global batch is sized by its measured speed, so
  a straggler gets less work instead of stalling everyone. Every sample is still used exactly once;
  the summation order changes, so the model differs from the reference by rounding, and the run
  reports by how much.
- ``local-sgd``: workers take ``sync_every_steps`` local steps between synchronisations and need
  no coordinator in between, so both sides of a partition keep training. At a sync, members'
  parameters are merged by the documented rule: the average weighted by the samples each trained
  since its last merge. A worker never runs more than ``max_staleness_steps`` local steps past its
  last merge: at the bound it blocks until it can merge.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from phalanx.core.errors import ConfigError


class ConsistencyMode(str, Enum):
    STRICT = "strict"
    AVAILABLE = "available"
    LOCAL_SGD = "local-sgd"


@dataclass(frozen=True)
class ModeConfig:
    mode: ConsistencyMode = ConsistencyMode.STRICT
    deadline_s: float = 0.25  # available: the least a formed step waits for members (at long steps: one step time)
    sync_every_steps: int = 10  # local-sgd: H, local steps between merges
    max_staleness_steps: int = 30  # local-sgd: local steps past the last merge before a worker blocks
    sync_timeout_s: float = 1.0  # local-sgd: how long a non-blocking sync attempt waits for a quorum

    def __post_init__(self) -> None:
        if self.deadline_s <= 0:
            raise ConfigError(f"deadline_s must be > 0, got {self.deadline_s}")
        if self.sync_every_steps < 1:
            raise ConfigError(f"sync_every_steps must be >= 1, got {self.sync_every_steps}")
        if self.max_staleness_steps < self.sync_every_steps:
            raise ConfigError(f"max_staleness_steps ({self.max_staleness_steps}) must be at least "
                              f"sync_every_steps ({self.sync_every_steps})")

    @staticmethod
    def parse(name: str) -> ConsistencyMode:
        try:
            return ConsistencyMode(name)
        except ValueError:
            raise ConfigError(f"unknown consistency mode {name!r}; choose one of "
                              f"{', '.join(m.value for m in ConsistencyMode)}") from None
