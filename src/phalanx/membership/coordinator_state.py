"""The coordinator's configuration and the records it keeps (one quorum in flight, commits)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
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


# Available mode's deadline follows the step (issue 12). A member this far behind its peers inside
# a step, measured in recent committed step times, is a straggler: a whole step behind. Ordinary
# skew between healthy members is a few tens of percent of a step and is not. The user's deadline_s
# stays the floor (at 25-40 ms steps it still decides), strict's timeouts the ceiling.
STEP_FACTOR = 1.0
STEP_WINDOW = 7  # commits in the running median: odd, and robust to a retried or healing step or two


def scaled_deadline_s(floor_s: float, recent_step_s: float, ceiling_s: float, factor: float = STEP_FACTOR) -> float:
    """``max(floor_s, factor * recent_step_s)``, capped at ``ceiling_s`` (strict's timeout). Monotone
    in the step time; at or above the floor unless the floor itself is above the ceiling."""
    return min(ceiling_s, max(floor_s, factor * max(recent_step_s, 0.0)))


def median_step_s(step_times_s: Sequence[float]) -> float:
    """The median of recent committed step times (0.0: none yet, the floor decides)."""
    s = sorted(step_times_s)
    n = len(s)
    if n == 0:
        return 0.0
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def apply_mode(cfg: CoordinatorConfig, recent_step_s: float = 0.0) -> CoordinatorConfig:
    """The timeouts each consistency mode implies (core.modes explains the modes).

    available: a formed step waits at most the deadline for members not yet asking, and a member
    that falls the deadline behind the others inside a step is dropped from it (it rejoins at the
    next step). The deadline is ``deadline_s`` or, at long steps, ``STEP_FACTOR`` recent step
    times (``scaled_deadline_s``), never above strict's timeouts. local-sgd: members with any state
    merge in instead of being healed over. ``cfg`` is the configuration before any mode applied.
    """
    m = cfg.modes
    if m.mode is ConsistencyMode.AVAILABLE:
        join_s = scaled_deadline_s(m.deadline_s, recent_step_s, cfg.quorum.join_timeout_s)
        progress_s = scaled_deadline_s(max(m.deadline_s, 0.1), recent_step_s, cfg.detector.progress_timeout_s)
        return replace(cfg, quorum=replace(cfg.quorum, join_timeout_s=join_s),
                       detector=replace(cfg.detector, progress_timeout_s=progress_s))
    if m.mode is ConsistencyMode.LOCAL_SGD:
        return replace(cfg, quorum=replace(cfg.quorum, merge_stale=True))
    return cfg


class StepPace:
    """The coordinator's running estimate of the committed step time, and the configuration it
    implies (available mode only: strict and local-sgd keep theirs, untouched). Deterministic in
    the commit records, so the simulator's virtual time drives it the same way."""

    def __init__(self, base: CoordinatorConfig) -> None:
        self.base = base  # before apply_mode: strict's timeouts are the ceilings
        self.active = base.modes.mode is ConsistencyMode.AVAILABLE
        self.step_times_s: deque[float] = deque(maxlen=STEP_WINDOW)
        self.commits_seen = 0

    def before_any_step(self) -> CoordinatorConfig:
        """The configuration until a step has been timed. Available mode starts at strict's
        timeouts: before any step time is known, a member still importing torch or building its
        first buckets cannot be told from a straggler (at 25 M parameters the user's 0.25 s floor
        dropped healthy members from the first steps, and the retried step rebuilt the group)."""
        return self.base if self.active else apply_mode(self.base)

    def on_commit(self, step_s: float, current: CoordinatorConfig) -> CoordinatorConfig:
        """The configuration after a commit that took ``step_s`` since the previous one."""
        self.commits_seen += 1
        if not self.active or self.commits_seen == 1:
            return current  # an incarnation's first commit also timed the start (workers importing torch)
        self.step_times_s.append(step_s)
        return apply_mode(self.base, median_step_s(self.step_times_s))


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
