"""Strict-mode data semantics: step s has a fixed global batch (seeded permutation per epoch),
split contiguously over whoever is in the quorum. Pure functions."""

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
