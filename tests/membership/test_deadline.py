"""Available mode's deadline follows the step (issue 12): ``max(deadline_s, k * recent step)``,
never above strict's timeouts; strict and local-sgd keep theirs. Pure functions, then the driver."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.core.modes import ConsistencyMode, ModeConfig
from phalanx.membership.coordinator_state import (
    STEP_FACTOR, STEP_WINDOW, CoordinatorConfig, StepPace, apply_mode, median_step_s, scaled_deadline_s,
)

times_s = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)
positive_s = st.floats(min_value=1e-3, max_value=1e3, allow_nan=False)


@given(floor_s=positive_s, ceiling_s=positive_s, a_s=times_s, b_s=times_s)
def test_the_deadline_is_monotone_in_the_step_time(floor_s, ceiling_s, a_s, b_s):
    lo, hi = sorted((a_s, b_s))
    assert scaled_deadline_s(floor_s, lo, ceiling_s) <= scaled_deadline_s(floor_s, hi, ceiling_s)


@given(floor_s=positive_s, ceiling_s=positive_s, step_s=times_s)
def test_the_deadline_is_never_below_the_floor_nor_above_strict(floor_s, ceiling_s, step_s):
    d = scaled_deadline_s(floor_s, step_s, ceiling_s)
    assert d <= ceiling_s  # strict's timeout bounds it
    assert d >= min(floor_s, ceiling_s)  # the user's deadline_s is the floor (as before, capped by strict)


@pytest.mark.parametrize("why, floor_s, step_s, ceiling_s, want_s", [
    ("fast steps: the floor decides, as before", 0.25, 0.03, 2.0, 0.25),
    ("no commit yet: the floor", 0.25, 0.0, 2.0, 0.25),
    ("long steps: a whole step", 0.25, 0.6, 2.0, 0.6 * STEP_FACTOR),
    ("very long steps: strict's timeout", 0.25, 30.0, 2.0, 2.0),
    ("a floor above strict: strict (as apply_mode always did)", 3.0, 0.1, 2.0, 2.0),
])
def test_scaled_deadline_table(why, floor_s, step_s, ceiling_s, want_s):
    assert scaled_deadline_s(floor_s, step_s, ceiling_s) == pytest.approx(want_s), why


@pytest.mark.parametrize("times, want_s", [
    ((), 0.0), ((0.5,), 0.5), ((0.5, 0.7), 0.6), ((0.6, 5.0, 0.55), 0.6),  # one retried step is no outlier
])
def test_median_step_s(times, want_s):
    assert median_step_s(times) == pytest.approx(want_s)


def _available(**modes) -> CoordinatorConfig:
    return CoordinatorConfig(modes=ModeConfig(mode=ConsistencyMode.AVAILABLE, **modes))


def test_apply_mode_without_a_step_time_is_what_it_was():
    cfg = apply_mode(_available())
    assert cfg.quorum.join_timeout_s == 0.25 and cfg.detector.progress_timeout_s == 0.25


def test_apply_mode_at_long_steps_scales_both_the_join_wait_and_the_progress_watch():
    base = _available()
    cfg = apply_mode(base, recent_step_s=0.6)
    assert cfg.detector.progress_timeout_s == pytest.approx(0.6 * STEP_FACTOR)
    # the join wait is capped by strict's own (0.5 s): a member that slow to ask is late in any mode
    assert cfg.quorum.join_timeout_s == pytest.approx(min(0.6 * STEP_FACTOR, base.quorum.join_timeout_s))
    slow = apply_mode(base, recent_step_s=100.0)
    assert slow.detector.progress_timeout_s == base.detector.progress_timeout_s  # strict's 2 s
    assert slow.quorum.join_timeout_s == base.quorum.join_timeout_s


@pytest.mark.parametrize("mode", [ConsistencyMode.STRICT, ConsistencyMode.LOCAL_SGD])
def test_strict_and_local_sgd_ignore_the_step_time(mode):
    base = CoordinatorConfig(modes=ModeConfig(mode=mode))
    assert apply_mode(base, recent_step_s=0.9) == apply_mode(base)
    pace = StepPace(base)
    cfg = pace.before_any_step()
    assert cfg == apply_mode(base)
    for _ in range(10):
        assert pace.on_commit(0.9, cfg) is cfg


def test_step_pace_skips_the_first_commit_and_follows_the_median_of_the_window():
    base = _available()
    pace = StepPace(base)
    cfg = pace.before_any_step()  # no step timed yet: strict's timeouts, not the 0.25 s floor
    assert cfg == base and cfg.detector.progress_timeout_s == 2.0
    cfg = pace.on_commit(40.0, cfg)  # the first commit timed the workers' start too: ignored
    assert cfg == base
    cfg = pace.on_commit(0.03, cfg)  # one step timed: the deadline applies (here the floor)
    assert cfg == apply_mode(base) and cfg.detector.progress_timeout_s == 0.25
    for _ in range(STEP_WINDOW):
        cfg = pace.on_commit(0.6, cfg)
    assert cfg.detector.progress_timeout_s == pytest.approx(0.6 * STEP_FACTOR)
    cfg = pace.on_commit(1.9, cfg)  # one retried step moves nothing
    assert cfg.detector.progress_timeout_s == pytest.approx(0.6 * STEP_FACTOR)
    for _ in range(STEP_WINDOW):  # the steps got fast again: back to the floor, within a window
        cfg = pace.on_commit(0.03, cfg)
    assert cfg == apply_mode(base)


def test_step_pace_keeps_the_users_deadline_as_the_floor():
    base = _available(deadline_s=1.5)
    pace = StepPace(base)
    cfg = pace.before_any_step()
    for _ in range(STEP_WINDOW + 1):
        cfg = pace.on_commit(0.6, cfg)
    assert cfg.detector.progress_timeout_s == 1.5
    assert cfg.quorum.join_timeout_s == base.quorum.join_timeout_s  # 1.5 capped by strict's 0.5, as before
