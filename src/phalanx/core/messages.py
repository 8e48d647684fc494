"""Every message that crosses the control plane. msgspec Structs, tagged, never pickled.

Worker -> coordinator, coordinator -> worker, and worker -> worker (healing). Each message that
belongs to a quorum carries its ``quorum_id`` so that the receiver can fence stale epochs.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

PROTOCOL_VERSION = 1

# Bounds checked when a frame is decoded, so an absurd value from a peer is a FrameRejected that
# names the field, never an overflow or an assert further in: steps and ids stay far below 2**63.
Count = Annotated[int, msgspec.Meta(ge=-1, le=2**62)]
Name = Annotated[str, msgspec.Meta(max_length=256)]
Text = Annotated[str, msgspec.Meta(max_length=8192)]
Names = Annotated[list[Name], msgspec.Meta(max_length=65_536)]


class _Msg(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    pass


# ---- handshake (first frame each way on every connection) ----
class ClientHello(_Msg):
    protocol_version: Count
    nonce: Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
    client: Name


class ServerHello(_Msg):
    protocol_version: Count
    nonce: Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]


class Refused(_Msg):
    """Sent just before closing a connection on purpose; says why."""

    reason: Text


# ---- worker -> coordinator ----
class Hello(_Msg):
    worker_id: Name
    incarnation: Name  # unique per process start, so a restarted worker is a new incarnation
    pid: Count
    heal_address: Name
    last_committed_step: Count
    max_quorum_id_seen: Count
    has_state: bool


class Heartbeat(_Msg):
    seq: Count
    step: Count


class QuorumRequest(_Msg):
    step: Count
    last_committed_step: Count
    has_state: bool
    total_steps: Count = -1  # the loop's length (-1: unknown); lets the coordinator finish catch-ups


class QuorumCancel(_Msg):
    """The worker stopped waiting for the quorum it asked for (local-sgd: a sync attempt timed out)."""

    step: Count


class Progress(_Msg):
    """A step-progress mark for the progress watch (e.g. phase='allreduce'), sent only when the
    phase lasts long enough to need one (in place of a heartbeat); ``age_s`` says how long ago the
    worker entered it, so the watch's clock starts when the phase did, not when the mark arrived."""

    step: Count
    quorum_id: Count
    phase: Name
    age_s: Annotated[float, msgspec.Meta(ge=0.0, le=86_400.0)] = 0.0


class AllreduceDone(_Msg):
    step: Count
    quorum_id: Count
    ok: bool
    error: Text = ""
    loss: float = 0.0
    samples_covered_once: bool = False
    compute_s: float = 0.0
    allreduce_s: float = 0.0
    # the fast path: on commit, this is also the worker's quorum request for this step (-1: none)
    next_step: Count = -1


class HealDone(_Msg):
    step: Count
    quorum_id: Count
    checksum: Name
    source: Name


class CheckpointWritten(_Msg):
    step: Count
    path: Text


class CheckpointUnusable(_Msg):
    """A worker could not restore the checkpoint it was told to: the coordinator stops offering it."""
    path: Text
    reason: Text


class Goodbye(_Msg):
    completed: bool
    reason: Text
    final_step: Count


# ---- coordinator -> worker ----
class Welcome(_Msg):
    run_id: Name
    store_address: Name
    heartbeat_interval_s: float
    collective_timeout_s: float
    checkpoint_every_steps: Count
    run_dir: Text
    mode: Name = "strict"  # core.modes.ConsistencyMode
    deadline_s: float = 0.25
    sync_every_steps: Count = 10
    max_staleness_steps: Count = 30
    sync_timeout_s: float = 1.0
    # a worker that finished holding the final state stays this long to heal a late peer
    drain_s: float = 5.0


class QuorumAssigned(_Msg):
    step: Count
    quorum_id: Count
    # [] = the members of quorum_id as this connection was first told them (an id always names the
    # same members; the list goes to each worker once per epoch, not with every step's grant)
    members: Names
    rank: Count
    heal_from: Name = ""  # worker id this member heals from before the step ("" = none)
    heal_address: Name = ""
    heal_targets: Names = []  # members that will heal from this worker
    restore_checkpoint: str = ""  # path of a durable checkpoint to restore ("" = none)
    write_checkpoint: bool = False  # this member writes the durable checkpoint after commit
    shard_span: list[float] = []  # available mode: [start, end] of this member's share of the batch, in [0, 1] ([] = even)
    local_step: Count = -1  # local-sgd: the furthest local step among the members; all continue from it
    catch_up: bool = False  # the job is over: restore or heal to the final state, nothing to compute


class QuorumBroken(_Msg):
    quorum_id: Count
    reason: Text


class StepDecision(_Msg):
    step: Count
    quorum_id: Count
    commit: bool
    reason: Text
    loss: float = 0.0


class InjectFault(_Msg):
    kind: Name
    for_s: float = 0.0
    phase: Name = ""
    at_step: Count = -1
    factor: float = 1.0
    # network faults (partition, latency, loss, bandwidth), applied by the worker at its seams
    groups: Annotated[list[Names], msgspec.Meta(max_length=256)] = []  # partition: node names per side; unnamed nodes and the coordinator: side 0
    one_way: bool = False  # partition: only side 0 -> other sides is cut
    mean_ms: float = 0.0
    jitter_ms: float = 0.0
    distribution: Name = "normal"  # constant | normal | pareto
    probability: float = 0.0  # loss per message, charged as retransmission timeouts
    bytes_per_s: float = 0.0
    peers: Names = []  # links to these peers only; [] = every link of this worker


class Shutdown(_Msg):
    reason: Text


# ---- worker -> worker (healing) ----
class HealRequest(_Msg):
    worker_id: Name
    quorum_id: Count
    step: Count


class HealOffer(_Msg):
    """Header of a live state transfer. The state follows as raw buffers in chunk frames."""

    quorum_id: Count
    step: Count
    state_header: bytes  # msgspec JSON from checkpoint.state_codec
    buffer_sizes: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=2**62)]], msgspec.Meta(max_length=1 << 22)]
    chunk_count: Count
    checksum: Name


class HealChunk(_Msg):
    index: Count


class HealAck(_Msg):
    quorum_id: Count
    checksum: Name
    ok: bool


# What a coordinator may bundle into one frame for one worker (same order as queued)
Bundled = Union[QuorumAssigned, QuorumBroken, StepDecision, InjectFault, Shutdown]
BUNDLE_MAX = 64


class Bundle(_Msg):
    """Several coordinator -> worker messages queued for the same worker at once, in one frame:
    typically a commit decision and the next step's grant (one write, one wakeup)."""

    items: Annotated[list[Bundled], msgspec.Meta(min_length=1, max_length=BUNDLE_MAX)]


Message = Union[
    ClientHello, ServerHello, Refused,
    Hello, Heartbeat, QuorumRequest, QuorumCancel, Progress, AllreduceDone, HealDone, CheckpointWritten,
    CheckpointUnusable, Goodbye,
    Welcome, QuorumAssigned, QuorumBroken, StepDecision, InjectFault, Shutdown, Bundle,
    HealRequest, HealOffer, HealChunk, HealAck,
]
