"""Quorum and commit decisions: pure functions of (now, state, config) returning a reason.

The coordinator's driver feeds these the current view and carries out what they decide. Quorum ids
strictly increase across distinct quorums; consecutive steps with the same healthy members keep
the same id (so the data-plane group is not rebuilt needlessly). The id is the fencing token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple


class MemberView(NamedTuple):
    """One session as the formation decision sees it. A named tuple (immutable, built in C): the
    coordinator builds one per session at every formation attempt, 1,024 a time at scale, where a
    frozen dataclass's per-field ``object.__setattr__`` cost 3 % of a simulated run."""

    worker_id: str
    healthy: bool
    waiting: bool  # has asked for a quorum for its next step
    waiting_since_s: float
    last_committed_step: int
    has_state: bool
    joined_at_s: float = 0.0


@dataclass(frozen=True)
class QuorumView:
    cluster_step: int  # last step committed anywhere in the cluster (-1: none)
    current_id: int  # id of the last quorum formed (0: none)
    current_members: tuple[str, ...]
    current_intact: bool  # no member of it lost and its last step did not abort
    checkpoint_step: int  # step of the newest durable checkpoint (-1: none)
    checkpoint_path: str = ""
    max_id_seen: int = 0  # highest id any worker reported (coordinator restarts stay above it)
    # A restarted coordinator: members of the last commit its predecessor recorded that have not
    # said Hello yet; any of them may hold that step, and none should be left behind.
    awaiting_holders: tuple[str, ...] = ()


@dataclass(frozen=True)
class QuorumConfig:
    min_workers: int = 1
    expected_workers: int = 1  # the first quorum waits for this many, up to initial_wait_s
    initial_wait_s: float = 60.0
    # after a coordinator restart: how long to wait for the last recorded commit's members, one of
    # which may hold it, before the step is redone without them
    rejoin_wait_s: float = 10.0
    join_timeout_s: float = 0.5  # how long a ready quorum waits for a connected worker not yet asking
    # local-sgd: a member holding any state merges in at the sync instead of being healed over
    merge_stale: bool = False
    # A broken quorum's recovery forms with the members that hold the step: a member that must
    # heal first (a restarted or returning worker) joins at the next formation, unless it has
    # waited this long (0: never deferred)
    defer_joiners_s: float = 5.0


class Action(Enum):
    WAIT = "wait"
    FORM = "form"
    STALL = "stall"  # cannot make progress without outside help (e.g. all state lost, no checkpoint)


@dataclass(frozen=True)
class QuorumDecision:
    action: Action
    reason: str
    quorum_id: int = 0
    step: int = -1
    members: tuple[str, ...] = ()
    heal_from: dict[str, str] = field(default_factory=dict)  # behind member -> up-to-date source
    restore_checkpoint: str = ""


def decide_quorum(now: float, members: Sequence[MemberView], view: QuorumView, cfg: QuorumConfig) -> QuorumDecision:
    healthy = sorted((m for m in members if m.healthy), key=lambda m: m.worker_id)
    waiting = [m for m in healthy if m.waiting]
    if not waiting:
        return QuorumDecision(Action.WAIT, "no worker is asking for a quorum")
    first_ask = min(m.waiting_since_s for m in waiting)
    # The job-start window applies to a real start only: a restarted coordinator (it has seen ids or
    # a committed step) must not wait initial_wait_s for a worker that may be dead.
    job_start = view.current_id == 0 and view.max_id_seen == 0 and view.cluster_step < 0
    if job_start and len(waiting) < cfg.expected_workers and now - first_ask < cfg.initial_wait_s:
        return QuorumDecision(Action.WAIT, f"first quorum: {len(waiting)} of {cfg.expected_workers} expected workers ready")
    if view.awaiting_holders:
        names = ", ".join(view.awaiting_holders)
        return QuorumDecision(Action.WAIT, f"coordinator restarted: waiting up to {cfg.rejoin_wait_s:g} s for "
                              f"{names}, members of the last recorded commit, to reconnect")
    # Wait a little for a member of the current quorum that has not asked yet (still finishing its
    # step, or its rollback); a newer coordinator, which formed nothing yet, waits for everyone
    # connected. A connected worker outside the quorum that has not asked (a replacement still
    # setting up after phalanx.join()) holds nobody up: it joins at the formation after it asks.
    # (It used to: every step waited join_timeout_s for it, 0.03 -> 0.55 s while a replacement
    # loaded its data for 2 s.)
    not_asking = [m for m in healthy if not m.waiting]
    if not_asking and view.current_id:  # (a set only when someone has not asked: 1,000s of members)
        current = set(view.current_members)
        not_asking = [m for m in not_asking if m.worker_id in current]
    if not_asking and now - first_ask < cfg.join_timeout_s:
        names = ", ".join(m.worker_id for m in not_asking)
        return QuorumDecision(Action.WAIT, f"waiting up to {cfg.join_timeout_s:.1f} s for {names}")
    if len(waiting) < cfg.min_workers:
        return QuorumDecision(Action.WAIT, f"{len(waiting)} workers ready, {cfg.min_workers} required")
    if cfg.defer_joiners_s > 0 and view.current_id > 0 and not view.current_intact:
        # A recovery (the last quorum lost a member or aborted its step): the survivors redo the
        # step now, and a member that would first need a heal (its state sent, loaded, and the
        # group built with it) joins at the next formation, which follows their commit. Its heal
        # then delays no recovery; it waits one step longer. Bounded: after defer_joiners_s of
        # waiting (quorums that keep breaking) it is not deferred again.
        holders = {m.worker_id for m in waiting if _holds_step(m, view, cfg.merge_stale)}
        ready = [m for m in waiting if m.worker_id in holders or now - m.waiting_since_s >= cfg.defer_joiners_s]
        if holders and len(ready) >= cfg.min_workers:
            waiting = ready
    return _form(waiting, view, cfg.merge_stale)


def _holds_step(m: MemberView, view: QuorumView, merge_stale: bool) -> bool:
    """``m`` can take part without a heal: it holds the last committed step (or, merging stale
    state in local-sgd, any state)."""
    return m.has_state and (merge_stale or m.last_committed_step == view.cluster_step)


def _form(waiting: list[MemberView], view: QuorumView, merge_stale: bool = False) -> QuorumDecision:
    step = view.cluster_step + 1
    ids = tuple(m.worker_id for m in waiting)
    current = [m for m in waiting if _holds_step(m, view, merge_stale)]
    restore = ""
    if view.cluster_step == -1 and not current:
        # Fresh start: the first member's initial state is the truth everyone copies.
        current = [waiting[0]]
    if not current:
        if view.checkpoint_step == view.cluster_step and view.checkpoint_path:
            restore = view.checkpoint_path
        else:
            newest = (f"the newest checkpoint is of step {view.checkpoint_step}" if view.checkpoint_step >= 0
                      else "there is no checkpoint")
            return QuorumDecision(
                Action.STALL,
                f"no connected worker holds step {view.cluster_step} and {newest}; waiting for a worker "
                "that holds it to (re)connect, else restart the job with --resume RUN_DIR to continue "
                "from the newest checkpoint",
            )
    sources = [m.worker_id for m in current]
    heal_from = {}
    if not restore:
        source_set = set(sources)
        behind = [m.worker_id for m in waiting if m.worker_id not in source_set]
        heal_from = {wid: sources[i % len(sources)] for i, wid in enumerate(behind)}
    reuse = view.current_intact and ids == view.current_members and not heal_from and not restore
    qid = view.current_id if reuse else max(view.current_id, view.max_id_seen) + 1
    assert qid >= view.current_id, "quorum ids never go back"
    why = "same members" if reuse else f"members {list(ids)}"
    if heal_from:
        why += f"; healing {sorted(heal_from)}"
    if restore:
        why += f"; restoring checkpoint of step {view.checkpoint_step}"
    return QuorumDecision(Action.FORM, why, qid, step, ids, heal_from, restore)


class Verdict(Enum):
    WAIT = "wait"
    COMMIT = "commit"
    ABORT = "abort"


@dataclass(frozen=True)
class Report:
    ok: bool
    covered_once: bool
    error: str = ""


def decide_commit(members: Sequence[str], live: Sequence[str], reports: dict[str, Report],
                  require_coverage: bool = True) -> tuple[Verdict, str]:
    """Commit a step when every live member reports a successful all-reduce.

    A successful all-reduce on any member proves every member contributed its gradients, so a
    member lost *after* the collective does not invalidate the step. Any reported failure aborts it.
    ``require_coverage`` is off for local-sgd merges, which carry parameters, not a global batch.
    """
    for wid in sorted(reports):
        r = reports[wid]
        if not r.ok:
            return Verdict.ABORT, f"{wid} reported: {r.error or 'all-reduce failed'}"
        if require_coverage and not r.covered_once:
            return Verdict.ABORT, f"{wid}: the global batch was not covered exactly once"
    live_set = set(live)
    live_members = [w for w in members if w in live_set]
    missing = [w for w in live_members if w not in reports]
    if missing:
        if not live_members:
            return Verdict.ABORT, "every member was lost"
        return Verdict.WAIT, f"waiting for {', '.join(missing)}"
    if not reports:
        return Verdict.ABORT, "every member was lost before reporting"
    return Verdict.COMMIT, f"{len(reports)} of {len(members)} members reported success"
