"""TailLayout: the coverage tail's fill and check, against a plain reading of the layout.

``verify`` compares bytes where the dtypes match; these cases pin that it answers exactly as
``np.array_equal`` over the coverage would, for sums that cover the batch once and for those
that miss a sample, double one, or carry a value no sum of members should (-0.0, NaN)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.train.step_buffer import TailLayout, expected_coverage


def _members_sum(gbs: int, members: int, batch: np.ndarray, dtype: type) -> np.ndarray:
    layout = TailLayout(gbs)
    total = np.zeros(layout.size, dtype=dtype)
    base, extra = divmod(gbs, members)
    offset = 0
    for r in range(members):
        count = base + (1 if r < extra else 0)
        buf = np.full(layout.size, 7.0, dtype=dtype)  # fill must overwrite whatever was there
        layout.fill(buf, offset, batch[offset : offset + count], 0.5, count / gbs)
        total += buf
        offset += count
    return total


@settings(max_examples=60, deadline=None)
@given(gbs=st.integers(1, 300), members=st.integers(1, 8), step=st.integers(0, 50),
       dtype=st.sampled_from([np.float32, np.float64]))
def test_a_once_covered_batch_verifies(gbs: int, members: int, step: int, dtype: type) -> None:
    members = min(members, gbs)
    batch = np.asarray(expected_coverage(step, 1000, gbs, 3, np.float64) - 1, dtype=np.int64)
    total = _members_sum(gbs, members, batch, dtype)
    ok, loss = TailLayout(gbs).verify(total, expected_coverage(step, 1000, gbs, 3, dtype))
    assert ok
    assert abs(loss - 0.5) < 1e-6


@settings(max_examples=80, deadline=None)
@given(gbs=st.integers(2, 200), pos=st.integers(0, 10_000),
       damage=st.sampled_from(["missing", "doubled", "negative zero", "nan", "off by one"]),
       dtype=st.sampled_from([np.float32, np.float64]))
def test_verify_answers_as_array_equal_does(gbs: int, pos: int, damage: str, dtype: type) -> None:
    expected = expected_coverage(1, 1000, gbs, 3, dtype)
    total = np.concatenate([expected, [0.25]]).astype(dtype)
    i = pos % gbs
    if damage == "missing":
        total[i] = 0
    elif damage == "doubled":
        total[i] *= 2
    elif damage == "negative zero":
        total[i] = -0.0
    elif damage == "nan":
        total[i] = np.nan
    else:
        total[i] += 1
    ok, _ = TailLayout(gbs).verify(total, expected)
    assert ok is False
    assert ok == bool(np.array_equal(total[:gbs], expected))


def test_verify_across_dtypes_and_without_an_expectation() -> None:
    expected64 = expected_coverage(2, 500, 16, 1, np.float64)
    total32 = np.concatenate([expected64, [1.0]]).astype(np.float32)
    assert TailLayout(16).verify(total32, expected64)[0] is True  # values, not bytes, across dtypes
    assert TailLayout(16).verify(total32, None)[0] is False
