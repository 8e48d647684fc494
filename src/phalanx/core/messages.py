"""Every message that crosses the control plane. msgspec Structs, tagged, never pickled.

Worker -> coordinator, coordinator -> worker, and worker -> worker (healing). Each message that
belongs to a quorum carries its ``quorum_id`` so that the receiver can fence stale epochs.
"""

from __future__ import annotations

from typing import Union

import msgspec

PROTOCOL_VERSION = 1


class _Msg(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    pass


# ---- handshake (first frame each way on every connection) ----
class ClientHello(_Msg):
    protocol_version: int
    nonce: bytes
    client: str


class ServerHello(_Msg):
    protocol_version: int
    nonce: bytes


class Refused(_Msg):
    """Sent just before closing a connection on purpose; says why."""

    reason: str


# ---- worker -> coordinator ----
class Hello(_Msg):
    worker_id: str
    incarnation: str  # unique per process start, so a restarted worker is a new incarnation
    pid: int
    heal_address: str
    last_committed_step: int
    max_quorum_id_seen: int
    has_state: bool


class Heartbeat(_Msg):
    seq: int
    step: int


class QuorumRequest(_Msg):
    step: int
    last_committed_step: int
    has_state: bool
    total_steps: int = -1  # the loop's length (-1: unknown); lets the coordinator finish catch-ups


class QuorumCancel(_Msg):
    """The worker stopped waiting for the quorum it asked for (local-sgd: a sync attempt timed out)."""

    step: int


class Progress(_Msg):
    """A step-progress mark for the progress watch (e.g. phase='allreduce')."""

    step: int
    quorum_id: int
    phase: str


class AllreduceDone(_Msg):
    step: int
    quorum_id: int
    ok: bool
    error: str = ""
    loss: float = 0.0
    samples_covered_once: bool = False
    compute_s: float = 0.0
    allreduce_s: float = 0.0


class HealDone(_Msg):
    step: int
    quorum_id: int
    checksum: str
    source: str


class CheckpointWritten(_Msg):
    step: int
    path: str


class CheckpointUnusable(_Msg):
    """A worker could not restore the checkpoint it was told to: the coordinator stops offering it."""
    path: str
    reason: str


class Goodbye(_Msg):
    completed: bool
    reason: str
    final_step: int


# ---- coordinator -> worker ----
class Welcome(_Msg):
    run_id: str
    store_address: str
    heartbeat_interval_s: float
    collective_timeout_s: float
    checkpoint_every_steps: int
    run_dir: str
    mode: str = "strict"  # core.modes.ConsistencyMode
    deadline_s: float = 0.25
    sync_every_steps: int = 10
    max_staleness_steps: int = 30
    sync_timeout_s: float = 1.0
    # a worker that finished holding the final state stays this long to heal a late peer
    drain_s: float = 5.0


class QuorumAssigned(_Msg):
    step: int
    quorum_id: int
    members: list[str]
    rank: int
    heal_from: str = ""  # worker id this member heals from before the step ("" = none)
    heal_address: str = ""
    heal_targets: list[str] = []  # members that will heal from this worker
    restore_checkpoint: str = ""  # path of a durable checkpoint to restore ("" = none)
    write_checkpoint: bool = False  # this member writes the durable checkpoint after commit
    shard_weights: list[float] = []  # available mode: each member's share of the global batch ([] = even)
    local_step: int = -1  # local-sgd: the furthest local step among the members; all continue from it
    catch_up: bool = False  # the job is over: restore or heal to the final state, nothing to compute


class QuorumBroken(_Msg):
    quorum_id: int
    reason: str


class StepDecision(_Msg):
    step: int
    quorum_id: int
    commit: bool
    reason: str
    loss: float = 0.0


class InjectFault(_Msg):
    kind: str
    for_s: float = 0.0
    phase: str = ""
    at_step: int = -1
    factor: float = 1.0
    # network faults (partition, latency, loss, bandwidth), applied by the worker at its seams
    groups: list[list[str]] = []  # partition: node names per side; unnamed nodes and the coordinator: side 0
    one_way: bool = False  # partition: only side 0 -> other sides is cut
    mean_ms: float = 0.0
    jitter_ms: float = 0.0
    distribution: str = "normal"  # constant | normal | pareto
    probability: float = 0.0  # loss per message, charged as retransmission timeouts
    bytes_per_s: float = 0.0
    peers: list[str] = []  # links to these peers only; [] = every link of this worker


class Shutdown(_Msg):
    reason: str


# ---- worker -> worker (healing) ----
class HealRequest(_Msg):
    worker_id: str
    quorum_id: int
    step: int


class HealOffer(_Msg):
    """Header of a live state transfer. The state follows as raw buffers in chunk frames."""

    quorum_id: int
    step: int
    state_header: bytes  # msgspec JSON from checkpoint.state_codec
    buffer_sizes: list[int]
    chunk_count: int
    checksum: str


class HealChunk(_Msg):
    index: int


class HealAck(_Msg):
    quorum_id: int
    checksum: str
    ok: bool


Message = Union[
    ClientHello, ServerHello, Refused,
    Hello, Heartbeat, QuorumRequest, QuorumCancel, Progress, AllreduceDone, HealDone, CheckpointWritten,
    CheckpointUnusable, Goodbye,
    Welcome, QuorumAssigned, QuorumBroken, StepDecision, InjectFault, Shutdown,
    HealRequest, HealOffer, HealChunk, HealAck,
]
