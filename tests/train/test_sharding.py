from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.train import sharding


@pytest.mark.parametrize("world", [1, 2, 3, 5, 7])
def test_shards_partition_the_global_batch_for_any_world_size(world):
    gb = sharding.global_batch(17, 1000, 32, seed=3)
    parts = [sharding.shard(17, 1000, 32, 3, r, world) for r in range(world)]
    assert np.array_equal(np.concatenate(parts), gb)
    assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1


def test_every_sample_once_per_epoch_and_epochs_reshuffle():
    n, gbs = 100, 8
    spe = sharding.steps_per_epoch(n, gbs)
    assert spe == 12  # the remainder of 4 samples is dropped each epoch
    for epoch in range(3):
        tally = Counter(int(i) for s in range(epoch * spe, (epoch + 1) * spe)
                        for i in sharding.global_batch(s, n, gbs, 0))
        assert len(tally) == spe * gbs and set(tally.values()) == {1}
    assert not np.array_equal(sharding.global_batch(0, n, gbs, 0), sharding.global_batch(spe, n, gbs, 0))


def test_the_global_batch_depends_only_on_step_and_seed():
    a = sharding.global_batch(5, 500, 16, seed=1)
    assert np.array_equal(a, sharding.global_batch(5, 500, 16, seed=1))
    assert not np.array_equal(a, sharding.global_batch(5, 500, 16, seed=2))


def test_impossible_splits_are_errors():
    with pytest.raises(ValueError):
        sharding.shard_bounds(4, 0, 5)
    with pytest.raises(ValueError):
        sharding.steps_per_epoch(10, 11)


def weighted_shard_bounds(gbs, weights, rank):
    """What a member with these weights gets: the coordinator's spans, then the member's own slice."""
    from phalanx.membership.policy import shard_spans

    start, end = shard_spans(weights)[rank]
    return sharding.span_shard_bounds(gbs, start, end, rank, len(weights))


@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1 / 3], [5.0, 0.01], [0.2, 0.3, 0.5]])
def test_weighted_shares_cover_the_batch_exactly_once_and_follow_the_weights(weights):
    gbs = 32
    bounds = [weighted_shard_bounds(gbs, weights, r) for r in range(len(weights))]
    assert [o for o, _ in bounds] == [sum(c for _, c in bounds[:r]) for r in range(len(weights))]
    assert sum(c for _, c in bounds) == gbs and all(c >= 1 for _, c in bounds)
    for (_, c), w in zip(bounds, weights):
        assert abs(c - gbs * w / sum(weights)) <= 1.0 + 1e-9 or c == 1


def test_a_straggler_at_a_third_of_the_speed_gets_about_a_third_of_the_share():
    counts = [weighted_shard_bounds(32, [1, 1, 1, 1 / 3], r)[1] for r in range(4)]
    assert counts[3] < min(counts[:3]) and counts[3] in (3, 4)


def test_weighted_shares_refuse_a_negative_weight():
    with pytest.raises(ValueError):  # its span runs backwards
        weighted_shard_bounds(32, [1.0, -0.5, 1.0], 1)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(min_value=1e-6, max_value=1e6, allow_nan=False), min_size=1, max_size=300),
       st.integers(min_value=0, max_value=4096))
def test_the_spans_the_coordinator_hands_out_tile_the_batch_exactly_once(weights, extra):
    from phalanx.membership.policy import shard_spans

    gbs = len(weights) + extra
    spans = shard_spans(weights)
    assert spans[0][0] == 0.0 and spans[-1][1] == 1.0
    bounds = [sharding.span_shard_bounds(gbs, a, b, r, len(weights)) for r, (a, b) in enumerate(spans)]
    assert [o for o, _ in bounds] == [sum(c for _, c in bounds[:r]) for r in range(len(weights))]
    assert sum(c for _, c in bounds) == gbs and all(c >= 1 for _, c in bounds)


def test_a_span_outside_the_unit_interval_or_reversed_is_refused():
    for start, end in [(-0.1, 0.5), (0.5, 1.5), (0.6, 0.5), (float("nan"), 1.0)]:
        with pytest.raises(ValueError):
            sharding.span_shard_bounds(32, start, end, 0, 2)
