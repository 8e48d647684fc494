"""The fidelity benchmark's readings of a real run: the group build gap of each new quorum (from
the workers' ``exchange_open`` spans) and where the time went, step by step (from the commits)."""

import pytest

from phalanx.bench.fidelity import decision_spread_s, group_build_gaps_s, step_budget


def _commit(step, qid, members, step_s=0.1):
    return {"step": step, "quorum_id": qid, "members": members, "step_s": step_s}


def _span(node, name, step, mono, dur, qid=None):
    return {"node": node, "span": name, "step": step, "mono": mono, "dur": dur,
            **({"quorum_id": qid} if qid is not None else {})}


def test_group_build_gap_runs_from_the_last_member_asking_for_the_group_to_the_last_holding_it():
    commits = [_commit(9, 1, ["w0", "w1"]), _commit(10, 2, ["w0", "w1", "w2"]), _commit(11, 2, ["w0", "w1", "w2"])]
    spans = [
        _span("w0", "exchange_open", 10, 1.01, 0.06, 2), _span("w1", "exchange_open", 10, 1.00, 0.07, 2),
        _span("w2", "exchange_open", 10, 1.05, 0.03, 2),  # the joiner heals first: asks last, at 1.05
        # the group forms once all are there; the last to hold it does so at 1.08
        _span("w0", "compute", 10, 1.01, 0.05, 2), _span("w2", "compute", 10, 1.05, 0.05, 2),
        # step 11 keeps quorum 2: no build
        _span("w0", "compute", 11, 1.30, 0.05, 2),
    ]
    assert group_build_gaps_s(commits, spans) == [pytest.approx(0.03)]


def test_group_build_gap_ignores_other_attempts_and_quorums_a_member_left_no_span_for():
    commits = [_commit(4, 1, ["w0", "w1"]), _commit(5, 3, ["w0", "w1"]), _commit(6, 4, ["w0", "w9"])]
    spans = [
        _span("w0", "exchange_open", 5, 0.50, 0.05, 2),  # quorum 2's attempt, rolled back
        _span("w0", "exchange_open", 5, 0.61, 0.03, 3), _span("w1", "exchange_open", 5, 0.62, 0.01, 3),
        _span("w0", "exchange_open", 6, 0.80, 0.01, 4),  # w9 left none
    ]
    assert group_build_gaps_s(commits, spans) == [pytest.approx(0.64 - 0.62)]


def test_step_budget_splits_same_quorum_steps_by_world_and_new_quorums_by_change():
    commits = [_commit(s, 1, ["w0", "w1"], 9.0) for s in range(5)]  # the first five are skipped
    commits += [_commit(5, 1, ["w0", "w1"], 0.1), _commit(6, 2, ["w0"], 0.5), _commit(7, 2, ["w0"], 0.2),
                _commit(8, 2, ["w0"], 0.4)]
    b = step_budget(commits)
    assert b["2 workers, same quorum"] == {"steps": 1, "total_s": pytest.approx(0.1), "mean_s": pytest.approx(0.1)}
    assert b["first step of a new quorum, 2 -> 1 workers"]["total_s"] == pytest.approx(0.5)
    assert b["1 workers, same quorum"] == {"steps": 2, "total_s": pytest.approx(0.6), "mean_s": pytest.approx(0.3)}


def test_decision_spread_is_how_far_apart_the_members_committed_all_reduce_spans_end():
    commits = [_commit(s, 1, ["w0", "w1"]) for s in range(7)] + [_commit(7, 2, ["w0", "w1", "w2"])]
    spans = [
        {**_span("w0", "allreduce", 5, 1.00, 0.02, 1), "commit": True},  # ends 1.02
        {**_span("w1", "allreduce", 5, 1.01, 0.025, 1), "commit": True},  # ends 1.035: 15 ms later
        {**_span("w0", "allreduce", 6, 2.00, 0.02, 1), "commit": True},
        {**_span("w1", "allreduce", 6, 2.00, 0.021, 1), "commit": True},  # 1 ms
        {**_span("w0", "allreduce", 6, 1.90, 0.5, 1), "commit": False},  # an aborted attempt: not a decision
        # step 7 is a new quorum's first step (a build, a heal): not counted
        {**_span("w0", "allreduce", 7, 3.0, 0.02, 2), "commit": True},
        {**_span("w1", "allreduce", 7, 3.0, 0.09, 2), "commit": True},
        {**_span("w2", "allreduce", 7, 3.0, 0.02, 2), "commit": True},
    ]
    assert decision_spread_s(commits, spans) == {2: pytest.approx(0.008)}
