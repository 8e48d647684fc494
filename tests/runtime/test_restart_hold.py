"""The launcher's restart hold: a replacement starts once the survivors have committed, never
while nothing else could commit, and never later than the bound."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.runtime.restart_hold import RESTART_HOLD_MAX_S, RestartHold


def test_a_replacement_waits_for_the_survivors_first_commit():
    hold = RestartHold(0.5)
    assert hold.hold("w1", 10.0, commits_total=30, running=3, min_workers=1)
    assert hold.due(10.05, 30) == []  # the survivors are still redoing the step
    assert hold.due(10.10, 31) == [("w1", pytest.approx(0.10))]
    assert len(hold) == 0 and hold.due(10.2, 40) == []  # started once


def test_the_hold_is_bounded():
    hold = RestartHold(0.5)
    assert hold.hold("w1", 10.0, 30, running=3, min_workers=1)
    assert hold.due(10.49, 30) == []
    assert hold.due(10.5, 30) == [("w1", pytest.approx(0.5))]


@pytest.mark.parametrize("commits, running, min_workers, max_s", [
    (None, 3, 1, 0.5),  # no coordinator in this process: nothing to watch
    (30, 1, 2, 0.5),  # one left running and a quorum needs two: the job waits for this worker
    (30, 0, 1, 0.5),  # nobody left running
    (30, 3, 1, 0.0),  # the hold is off
])
def test_no_hold_when_the_job_could_not_commit_without_the_worker_or_it_is_off(commits, running, min_workers, max_s):
    hold = RestartHold(max_s)
    assert not hold.hold("w1", 10.0, commits, running, min_workers)
    assert len(hold) == 0


def test_everything_held_starts_when_nothing_else_runs():
    hold = RestartHold(0.5)
    hold.hold("w1", 10.0, 30, running=2, min_workers=1)
    hold.hold("w2", 10.02, 30, running=1, min_workers=1)
    assert [w for w, _ in hold.due(10.05, 30, all_of_them=True)] == ["w1", "w2"]


def test_a_bad_bound_is_refused_by_value():
    with pytest.raises(ValueError, match="-1"):
        RestartHold(-1)
    with pytest.raises(ValueError, match="nan"):
        RestartHold(float("nan"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 2), st.integers(0, 3)), min_size=1, max_size=30))
def test_every_held_worker_starts_exactly_once_within_the_bound(ticks):
    """Whatever the commits do, each held worker is released once, no later than the bound (to
    the launcher's tick), and never before a commit unless the bound passed."""
    hold = RestartHold(RESTART_HOLD_MAX_S)
    now, commits = 0.0, 0
    hold.hold("a", now, commits, 3, 1)
    started: list[tuple[str, float]] = []
    for dt, dc in ticks:
        now += dt
        commits += dc
        for w, held in hold.due(now, commits):
            started.append((w, held))
            assert held >= RESTART_HOLD_MAX_S or commits > 0
    started += hold.due(now + RESTART_HOLD_MAX_S, commits)
    assert [w for w, _ in started] == ["a"]
