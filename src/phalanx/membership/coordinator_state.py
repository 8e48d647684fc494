"""The coordinator's configuration and the records it keeps (one quorum in flight, commits)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from phalanx.core.modes import ConsistencyMode, ModeConfig
from phalanx.membership import failure_detector as fd
from phalanx.membership.quorum import QuorumConfig, Report

ID_LIMIT = 2**62  # quorum ids and steps stay far below the codec's 64-bit integers
EVENTS_KEPT = 10_000  # in memory; the launcher streams every event to events.jsonl


@dataclass(frozen=True)
class CoordinatorConfig:
    detector: fd.DetectorConfig = fd.DetectorConfig()
    quorum: QuorumConfig = QuorumConfig()
    collective_timeout_s: float = 5.0
    checkpoint_every_steps: int = 0
    tick_s: float = 0.02
    run_dir: str = ""  # "" = no durable storage: the last step is not checkpointed
    run_id: str = "run"
    modes: ModeConfig = ModeConfig()
    # how long a worker that finished holding the final state stays to heal a late peer (a frozen
    # worker that wakes after the last step); released at once when every worker said Goodbye
    drain_s: float = 5.0
    sessions_max: int = 4096  # distinct worker ids; a Hello beyond it is refused
    session_keep_s: float = 60.0  # a departed, finished session is forgotten this long after it left
    # commit records kept in memory (a ring); every record also goes to the on_commit sink as it
    # commits (a real run's: RUN/commits.jsonl, membership/commit_log.py)
    commits_kept: int = 4096


def apply_mode(cfg: CoordinatorConfig) -> CoordinatorConfig:
    """The timeouts each consistency mode implies (core.modes explains the modes).

    available: a formed step waits at most ``deadline_s`` for members not yet asking, and a member
    that falls ``deadline_s`` behind the others inside a step is dropped from it (it rejoins at the
    next step). local-sgd: members with any state merge in instead of being healed over.
    """
    m = cfg.modes
    if m.mode is ConsistencyMode.AVAILABLE:
        q = replace(cfg.quorum, join_timeout_s=min(cfg.quorum.join_timeout_s, m.deadline_s))
        d = replace(cfg.detector, progress_timeout_s=min(cfg.detector.progress_timeout_s, max(m.deadline_s, 0.1)))
        return replace(cfg, quorum=q, detector=d)
    if m.mode is ConsistencyMode.LOCAL_SGD:
        return replace(cfg, quorum=replace(cfg.quorum, merge_stale=True))
    return cfg


@dataclass
class CurrentQuorum:
    quorum_id: int
    step: int
    members: tuple[str, ...]
    formed_at_s: float
    intact: bool = True
    decided: bool = False
    reports: dict[str, Report] = field(default_factory=dict)
    losses: dict[str, float] = field(default_factory=dict)
    member_set: frozenset[str] = frozenset()  # for O(1) membership checks per message
    weights: dict[str, float] = field(default_factory=dict)  # available mode: share of the batch per member


@dataclass(frozen=True)
class CommitRecord:
    step: int
    quorum_id: int
    members: tuple[str, ...]
    loss: float
    committed_at_s: float
    step_s: float
    covered_once: bool
