"""The coordinator's policies: pure functions of (state, config), each tested with a table.

The coordinator's driver (coordinator.py) does the I/O and asks these what to do: how fast each
worker is, how the batch is shared, whether the job is over, who writes a checkpoint, whether a
restarted coordinator still waits for its predecessor's last members, whether a worker's claim
about itself is believable.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from phalanx.core.modes import ConsistencyMode


def updated_speed(old: float | None, share: float, compute_s: float) -> float | None:
    """Available mode: a worker's speed (share of the global batch per compute second), a moving
    average in which each new measurement weighs half. None: nothing measurable yet."""
    if share <= 0 or compute_s <= 0:
        return old
    speed = share / compute_s
    return speed if old is None else 0.5 * old + 0.5 * speed


# A member measured within this factor of the median speed counts as the median: on a box with
# more busy threads than cores one step's compute time varies up to 3x with the scheduler alone,
# and chasing that gave uneven shares that cost available mode 5.6 % a step (docs/BENCHMARKS.md,
# session 20); a straggler 2x or more behind still gets its smaller share.
SPEED_TOLERANCE = 2.0


def shard_weights(mode: ConsistencyMode, members: Sequence[str], speeds: Mapping[str, float]) -> list[float]:
    """Available mode: shares proportional to measured speed (unmeasured members get the mean),
    where a speed within ``SPEED_TOLERANCE`` of the (low) median counts as that median. Other
    modes: [] (even shares)."""
    if mode is not ConsistencyMode.AVAILABLE or not members:
        return []
    known = [speeds[w] for w in members if w in speeds]
    if not known:
        return [1.0 / len(members)] * len(members)
    mean = sum(known) / len(known)
    raw = [speeds.get(w, mean) for w in members]
    median = statistics.median_low(raw)  # a member's own speed: with two, the slower one's
    raw = [median if median / SPEED_TOLERANCE <= r <= median * SPEED_TOLERANCE else r for r in raw]
    total = sum(raw)
    return [r / total for r in raw]


def shard_spans(weights: Sequence[float]) -> list[tuple[float, float]]:
    """Each member's span [start, end) of [0, 1] for ``weights`` (from :func:`shard_weights`; []
    for even shares): the running sum, so a member's end is the very float its successor starts
    at, and the last ends at exactly 1.0. A member's grant carries its own span, not every
    weight (O(1) a grant: the weights were 8 MB a step at 1,024 workers)."""
    if not weights:
        return []
    total, acc, bounds = sum(weights), 0.0, [0.0]
    for w in weights[:-1]:
        acc += w
        bounds.append(acc / total)
    bounds.append(1.0)
    return list(zip(bounds, bounds[1:]))


def job_finished(mode: ConsistencyMode, total_steps: int, cluster_step: int, completed_workers: int) -> bool:
    """strict/available: the last step is committed. local-sgd: its steps are local, so a worker
    that finished (after its final merge) ends the job."""
    if mode is ConsistencyMode.LOCAL_SGD:
        return completed_workers > 0
    return total_steps > 0 and cluster_step >= total_steps - 1


@dataclass(frozen=True)
class CheckpointPolicy:
    every_steps: int  # 0: no periodic checkpoints
    final: bool  # always checkpoint the job's last step (the run has durable storage)


def checkpoint_writer(policy: CheckpointPolicy, mode: ConsistencyMode, total_steps: int, step: int,
                      local_step: int, members: Sequence[str], healing: Collection[str]) -> str:
    """Who writes a durable checkpoint after ``step`` commits ("": nobody): every K steps, and the
    job's last step (a worker that wakes after every peer has left restores it). A member that is
    not healing writes: it already holds the state."""
    if mode is ConsistencyMode.LOCAL_SGD:
        last = total_steps > 0 and local_step >= total_steps
    else:
        last = total_steps > 0 and step == total_steps - 1
    periodic = policy.every_steps > 0 and (step + 1) % policy.every_steps == 0
    if not (periodic or (last and (policy.final or policy.every_steps > 0))) or not members:
        return ""
    return next((w for w in members if w not in healing), members[0])


def awaiting_holders(now_s: float, rejoin_wait_s: float, floor_members: Collection[str],
                     present: Collection[str]) -> tuple[tuple[str, ...], bool]:
    """A restarted coordinator: members of the last commit its predecessor recorded that have not
    said Hello yet (any may hold that step). Returns (missing, expired): ``now_s`` counts from this
    incarnation's start; once every member is present or ``rejoin_wait_s`` passed, nobody is
    awaited."""
    missing = tuple(sorted(m for m in floor_members if m not in present))
    if missing and now_s > rejoin_wait_s:
        return missing, True
    return missing, False


def hello_refusal(claimed_step: int, claimed_id: int, authoritative: bool, cluster_step: int,
                  max_id_seen: int, id_limit: int) -> str:
    """Why a Hello's claims cannot be true ("" = acceptable). A coordinator that has itself formed
    quorums knows every step and id issued since; a worker claiming more is buggy or hostile and
    would corrupt the cluster step or the fencing ids. A fresh incarnation (after a restart)
    learns the cluster's state from the Hellos, within the codec's bound."""
    if claimed_id > id_limit or claimed_step > id_limit:
        return f"claimed step {claimed_step} / quorum id {claimed_id} beyond the limit {id_limit}"
    if authoritative and claimed_step > cluster_step:
        return f"claims committed step {claimed_step}, but the cluster's last committed step is {cluster_step}"
    if authoritative and claimed_id > max_id_seen:
        return f"claims quorum id {claimed_id}, but no quorum id above {max_id_seen} was ever issued"
    return ""
