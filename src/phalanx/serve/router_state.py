"""The router's configuration, its view of one replica, and the ways one try can fail (kept apart from the
driver in ``router``, which re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx.membership.failure_detector import DetectorConfig
from phalanx.serve.replica_client import ReplicaConnections
from phalanx.serve.routing_policy import PolicyConfig, ReplicaStats
from phalanx.serve.versions import Consistency


@dataclass(frozen=True)
class RouterConfig:
    model_name: str = "phalanx-charlm"
    policy: PolicyConfig = PolicyConfig()
    detector: DetectorConfig = DetectorConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.6)
    progress_timeout_s: float = 0.8  # a running batch whose step count stands still this long: hung ...
    progress_steps_max: float = 5.0  # ... and this many of its own recent step times (a straggler is slow, not hung)
    readmit_heartbeats: int = 3  # a returning replica must answer this many polls in a row
    active_requests_max: int = 256  # admission control: beyond this, 429 with Retry-After
    attempts_max: int = 4
    stall_s: float = 1.0  # a stream that sends nothing for this long is resumed elsewhere
    request_timeout_s: float = 60.0
    hedging: bool = False
    consistency: Consistency = Consistency.CONSISTENT  # during a rollout: no version regression per session
    version_wait_s: float = 2.0  # a request held back by a rollout (no replica at its session's version) waits
    # this long for one, then gets 503 with Retry-After
    outage_wait_s: float = 2.0  # no replica in rotation at all: a request waits for one while the outage is younger
    # than this (every replica missing its polls at once on a starved box is a blip), then 503 (routing_policy.
    # may_wait_for_replica; docs/SERVING.md, "Session 15")


@dataclass
class ReplicaState:
    stats: ReplicaStats
    url: str
    connected: bool = False
    last_heartbeat_s: float = 0.0
    good_polls: int = 0
    steps: int = -1
    steps_changed_s: float = 0.0
    busy: bool = False
    ever_healthy: bool = False
    step_time_s: float = 0.0
    version: str = ""  # the weights it serves (its /health, or the answer to a rollout's load)
    admitting: bool = True  # False while a rollout drains and reloads it
    held: dict[int, tuple[float, bool]] = field(default_factory=dict)  # attempts with no output yet: key -> (start,
    # moved before); an ejection decides which of them move (routing_policy.held_to_move) ...
    move_keys: set[int] = field(default_factory=set)  # ... and marks them here; their attempt cancels itself
    conns: ReplicaConnections = field(init=False)  # unary calls (streams and polls use the httpx client)


class AttemptFailed(Exception):
    """One try at one replica failed in a way that is safe to retry elsewhere (nothing sent to the client).
    ``replica_gone``: the replica died or is draining (its requests move without adding load); ``moved``: its
    replica was ejected and the request moves off it (it will not move again)."""

    def __init__(self, message: str, replica_gone: bool = False, moved: bool = False) -> None:
        super().__init__(message)
        self.replica_gone = replica_gone or moved
        self.moved = moved


class NoHealthyReplica(AttemptFailed):
    """No replica is in rotation (all dead, frozen, or missing their polls): wait while the outage is young."""


class VersionHeldBack(AttemptFailed):
    """Healthy replicas exist, but none this request may use now (a rollout drains it, or the session has
    seen a newer version than they serve): wait briefly, then 503 with Retry-After."""
