"""What a worker is told and configured with: its agent's settings and a quorum assignment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from phalanx.train import sharding

__all__ = ["Assignment", "WorkerConfig"]


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    coordinator_address: str
    heal_bind: str = "127.0.0.1:0"
    connect_timeout_s: float = 10.0
    quorum_timeout_s: float = 300.0
    decision_timeout_s: float = 60.0
    heal_timeout_s: float = 60.0
    reconnect_timeout_s: float = 30.0
    heal_chunk_bytes: int = 16 * 1024 * 1024
    pid: int = 0  # reported in Hello; 0: this process's pid (the simulator passes a virtual one)


class Assignment(NamedTuple):
    """A granted step on a quorum, as this worker acts on it. A named tuple (immutable, built in
    C): every worker builds one per step from its grant."""

    step: int
    quorum_id: int
    members: tuple[str, ...]
    rank: int
    heal_from: str
    heal_address: str
    heal_targets: tuple[str, ...]
    restore_checkpoint: str
    write_checkpoint: bool
    shard_span: tuple[float, ...] = ()  # available mode: (start, end) of this member's share by speed (() = even)
    local_step: int = -1  # local-sgd: the step every member continues from after this merge
    catch_up: bool = False  # the job is over: restore or heal to the final state, then stop

    @property
    def world_size(self) -> int:
        return len(self.members)

    def shard_bounds(self, global_batch_size: int) -> tuple[int, int]:
        """(offset, count) of this member's slice of the global batch."""
        if self.shard_span:
            return sharding.span_shard_bounds(global_batch_size, self.shard_span[0], self.shard_span[1], self.rank,
                                              len(self.members))
        return sharding.shard_bounds(global_batch_size, self.rank, self.world_size)
