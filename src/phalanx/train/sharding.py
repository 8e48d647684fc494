"""Data semantics: step s has a fixed global batch (seeded permutation per epoch), split
contiguously over whoever is in the quorum: evenly in strict mode, by measured speed in available
mode. Pure functions."""

from __future__ import annotations

from functools import lru_cache

import numpy as np


def steps_per_epoch(dataset_size: int, global_batch_size: int) -> int:
    if global_batch_size <= 0 or global_batch_size > dataset_size:
        raise ValueError(f"global batch size {global_batch_size} must be in 1..dataset size {dataset_size}")
    return dataset_size // global_batch_size  # the remainder is dropped each epoch


@lru_cache(maxsize=4)
def _permutation(dataset_size: int, seed: int, epoch: int) -> np.ndarray:
    perm = np.random.Generator(np.random.PCG64([seed, epoch])).permutation(dataset_size)
    perm.flags.writeable = False
    return perm


def epoch_of(step: int, dataset_size: int, global_batch_size: int) -> int:
    return step // steps_per_epoch(dataset_size, global_batch_size)


def global_batch(step: int, dataset_size: int, global_batch_size: int, seed: int) -> np.ndarray:
    spe = steps_per_epoch(dataset_size, global_batch_size)
    perm = _permutation(dataset_size, seed, step // spe)
    start = (step % spe) * global_batch_size
    return perm[start : start + global_batch_size]


def shard_bounds(global_batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """(offset, count) of rank's contiguous slice; the first gbs % world ranks get one more."""
    if world_size < 1 or world_size > global_batch_size or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world size {world_size} cannot split a batch of {global_batch_size}")
    base, extra = divmod(global_batch_size, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def shard(step: int, dataset_size: int, global_batch_size: int, seed: int, rank: int, world_size: int) -> np.ndarray:
    offset, count = shard_bounds(global_batch_size, rank, world_size)
    return global_batch(step, dataset_size, global_batch_size, seed)[offset : offset + count]


def span_shard_bounds(global_batch_size: int, start: float, end: float, rank: int, world_size: int) -> tuple[int, int]:
    """(offset, count) of rank's contiguous slice when its share of the batch is the span
    [start, end) of [0, 1] (available mode: the coordinator hands each member its own span, so a
    grant is O(1) whatever the quorum's size). One sample each first, the rest by span; a boundary
    is rounded from the one float two neighbours share (one's end is the next one's start), so
    the slices tile the global batch exactly once, and the last span ends at exactly 1.0."""
    n = world_size
    if not 1 <= n <= global_batch_size or not 0 <= rank < n or not 0.0 <= start <= end <= 1.0:
        raise ValueError(f"cannot take span [{start}, {end}) of a batch of {global_batch_size} for rank {rank} of {n}")
    spare = global_batch_size - n
    offset = rank + int(spare * start + 0.5)
    return offset, rank + 1 + int(spare * end + 0.5) - offset


def samples_exactly_once(commits: "list[tuple[int, bool]]", total_steps: int, dataset_size: int,
                         global_batch_size: int, seed: int) -> bool:
    """The exactly-once tally, for real runs and the simulator: every step 0..total-1 committed
    once, each with its global batch covered exactly once inside the all-reduce (``commits`` is
    (step, covered) per commit), so every sample of each epoch was used exactly once: the
    per-epoch tally finds no sample twice, and a complete epoch misses none."""
    steps = [s for s, _ in commits]
    if sorted(steps) != list(range(total_steps)) or not all(covered for _, covered in commits):
        return False
    spe = steps_per_epoch(dataset_size, global_batch_size)
    for epoch in range((total_steps + spe - 1) // spe):
        epoch_steps = [x for x in steps if x // spe == epoch]
        used = np.concatenate([global_batch(x, dataset_size, global_batch_size, seed) for x in epoch_steps]) \
            if epoch_steps else np.zeros(0, np.int64)
        if len(np.unique(used)) != len(used):
            return False  # a sample used twice within one epoch
        if len(epoch_steps) == spe and len(used) != spe * global_batch_size:
            return False  # a complete epoch that missed samples
    return True
