"""Quorum and commit decisions are pure functions: tables of (state, time) -> decision."""

import pytest

from phalanx.membership.quorum import (
    Action, MemberView, QuorumConfig, QuorumView, Report, Verdict, decide_commit, decide_quorum,
)

CFG = QuorumConfig(min_workers=1, expected_workers=3, initial_wait_s=10.0, join_timeout_s=0.5)


def m(wid, healthy=True, waiting=True, since=0.0, committed=4, state=True):
    return MemberView(wid, healthy, waiting, since, committed, state)


STEADY = QuorumView(cluster_step=4, current_id=7, current_members=("a", "b", "c"), current_intact=True,
                    checkpoint_step=-1)
FRESH = QuorumView(cluster_step=-1, current_id=0, current_members=(), current_intact=False, checkpoint_step=-1)


@pytest.mark.parametrize("name, now, members, view, expect", [
    ("same healthy members keep the quorum id",
     1.0, [m("a"), m("b"), m("c")], STEADY, (Action.FORM, 7, ("a", "b", "c"), {})),
    ("a lost member gets a new, higher id",
     1.0, [m("a"), m("b"), m("c", healthy=False)], STEADY, (Action.FORM, 8, ("a", "b"), {})),
    ("a broken quorum gets a new id even with the same members",
     1.0, [m("a"), m("b"), m("c")], QuorumView(4, 7, ("a", "b", "c"), False, -1), (Action.FORM, 8, ("a", "b", "c"), {})),
    ("a member behind heals from an up-to-date one",
     1.0, [m("a"), m("b"), m("c", committed=-1, state=False)], STEADY, (Action.FORM, 8, ("a", "b", "c"), {"c": "a"})),
    ("waits for a healthy member that has not asked yet",
     0.2, [m("a"), m("b"), m("c", waiting=False)], STEADY, (Action.WAIT, None, None, None)),
    ("stops waiting for it after the join timeout",
     0.6, [m("a"), m("b"), m("c", waiting=False)], STEADY, (Action.FORM, 8, ("a", "b"), {})),
    ("a connected worker outside the quorum that has not asked holds nobody up (a replacement setting up)",
     0.2, [m("a"), m("b"), m("c"), m("d", waiting=False, committed=-1, state=False)], STEADY,
     (Action.FORM, 7, ("a", "b", "c"), {})),
    ("a coordinator that formed nothing yet waits for every connected worker",
     0.2, [m("a"), m("b"), m("c", waiting=False)], QuorumView(4, 0, (), False, -1, "", max_id_seen=41),
     (Action.WAIT, None, None, None)),
    ("first quorum waits for the expected workers",
     1.0, [m("a", committed=-1, state=False), m("b", committed=-1, state=False)], FRESH, (Action.WAIT, None, None, None)),
    ("fresh start: everyone copies the first member's initial state",
     1.0, [m(w, committed=-1, state=False) for w in "abc"], FRESH, (Action.FORM, 1, ("a", "b", "c"), {"b": "a", "c": "a"})),
    ("no live state and no checkpoint stalls with advice",
     1.0, [m(w, committed=-1, state=False) for w in "ab"], QuorumView(4, 7, ("a", "b"), False, -1),
     (Action.STALL, None, None, None)),
    ("ids stay above what workers saw from an earlier coordinator",
     1.0, [m("a"), m("b"), m("c")], QuorumView(4, 0, (), False, -1, "", max_id_seen=41),
     (Action.FORM, 42, ("a", "b", "c"), {})),
])
def test_quorum_decisions(name, now, members, view, expect):
    action, qid, ids, heal = expect
    cfg = CFG if view.current_id else QuorumConfig(expected_workers=3, initial_wait_s=10.0)
    d = decide_quorum(now, members, view, cfg)
    assert d.action is action, (name, d.reason)
    assert d.reason
    if action is Action.FORM:
        assert (d.quorum_id, d.members, d.heal_from) == (qid, ids, heal), name
        assert d.step == view.cluster_step + 1


BROKEN = QuorumView(cluster_step=4, current_id=7, current_members=("a", "b", "c"), current_intact=False,
                    checkpoint_step=-1)


@pytest.mark.parametrize("name, now, members, view, cfg, expect", [
    ("a recovery forms without the member that must heal first",
     1.0, [m("a"), m("b"), m("d", since=0.5, committed=-1, state=False)], BROKEN, CFG, (("a", "b"), {})),
    ("a member back from a freeze (behind, with state) waits for the next formation too",
     1.0, [m("a"), m("b"), m("c", since=0.5, committed=3)], BROKEN, CFG, (("a", "b"), {})),
    ("the next formation, after the survivors commit, takes it in with its heal",
     1.0, [m("a", committed=5), m("b", committed=5), m("d", since=0.5, committed=-1, state=False)],
     QuorumView(5, 8, ("a", "b"), True, -1), CFG, (("a", "b", "d"), {"d": "a"})),
    ("not deferred past the bound (quorums that keep breaking)",
     6.0, [m("a"), m("b"), m("d", since=0.5, committed=-1, state=False)], BROKEN, CFG,
     (("a", "b", "d"), {"d": "a"})),
    ("not deferred when the survivors alone are too few for a quorum",
     1.0, [m("a"), m("d", since=0.5, committed=-1, state=False)], BROKEN,
     QuorumConfig(min_workers=2, join_timeout_s=0.5), (("a", "d"), {"d": "a"})),
    ("not deferred when the setting is off (the coordinator turns it off once the job is over)",
     1.0, [m("a"), m("b"), m("d", since=0.5, committed=-1, state=False)], BROKEN,
     QuorumConfig(min_workers=1, join_timeout_s=0.5, defer_joiners_s=0.0), (("a", "b", "d"), {"d": "a"})),
    ("local-sgd merges stale state in: a member with any state is not deferred",
     1.0, [m("a"), m("b"), m("c", since=0.5, committed=3)], BROKEN,
     QuorumConfig(min_workers=1, join_timeout_s=0.5, merge_stale=True), (("a", "b", "c"), {})),
])
def test_a_recovery_defers_members_that_must_heal(name, now, members, view, cfg, expect):
    d = decide_quorum(now, members, view, cfg)
    assert d.action is Action.FORM, (name, d.reason)
    assert (d.members, d.heal_from) == expect, name


def test_quorum_ids_strictly_increase_across_membership_changes():
    view = STEADY
    last = view.current_id
    for lost in ["c", "b"]:
        alive = [x for x in ["a", "b", "c"] if x not in "bc"[: "cb".index(lost) + 1]]
        d = decide_quorum(1.0, [m(w) for w in alive], view, CFG)
        assert d.quorum_id > last
        last = d.quorum_id
        view = QuorumView(view.cluster_step, d.quorum_id, d.members, True, -1)


def test_all_state_lost_restores_from_a_checkpoint_of_the_cluster_step():
    view = QuorumView(cluster_step=49, current_id=0, current_members=(), current_intact=False,
                      checkpoint_step=49, checkpoint_path="/run/checkpoints/step_00000049")
    d = decide_quorum(1.0, [m(w, committed=-1, state=False) for w in "ab"], view, QuorumConfig(expected_workers=2))
    assert d.action is Action.FORM and d.restore_checkpoint.endswith("step_00000049") and d.step == 50


def test_min_workers_floor_is_respected():
    d = decide_quorum(5.0, [m("a")], STEADY, QuorumConfig(min_workers=2, expected_workers=1))
    assert d.action is Action.WAIT and "2 required" in d.reason


OK = Report(True, True)


@pytest.mark.parametrize("name, members, live, reports, verdict", [
    ("all live members succeeded", ("a", "b"), ("a", "b"), {"a": OK, "b": OK}, Verdict.COMMIT),
    ("waits for a live member", ("a", "b"), ("a", "b"), {"a": OK}, Verdict.WAIT),
    ("a member lost after a successful collective does not void the step",
     ("a", "b", "c"), ("a", "b"), {"a": OK, "b": OK}, Verdict.COMMIT),
    ("any failure aborts", ("a", "b"), ("a", "b"), {"a": OK, "b": Report(False, False, "reset")}, Verdict.ABORT),
    ("a coverage violation aborts", ("a", "b"), ("a", "b"), {"a": OK, "b": Report(True, False)}, Verdict.ABORT),
    ("everyone lost aborts", ("a", "b"), (), {}, Verdict.ABORT),
    ("lost before anyone reported aborts", ("a", "b"), ("a",), {}, Verdict.WAIT),
])
def test_commit_decisions(name, members, live, reports, verdict):
    v, why = decide_commit(members, live, reports)
    assert v is verdict, (name, why)
    assert why


def test_local_sgd_merges_a_member_that_is_behind_instead_of_healing_it_over():
    members = [m("a"), m("b"), m("c", committed=1)]  # c was cut off for three sync rounds but kept training
    strict = decide_quorum(1.0, members, STEADY, CFG)
    merge = decide_quorum(1.0, members, STEADY, QuorumConfig(1, 3, 10.0, 0.5, merge_stale=True))
    assert strict.heal_from == {"c": "a"}
    assert merge.action is Action.FORM and merge.heal_from == {} and merge.members == ("a", "b", "c")


def test_local_sgd_still_heals_a_member_with_no_state():
    cfg = QuorumConfig(1, 3, 10.0, 0.5, merge_stale=True)
    d = decide_quorum(1.0, [m("a"), m("b"), m("c", committed=-1, state=False)], STEADY, cfg)
    assert d.heal_from == {"c": "a"}


def test_a_merge_commits_without_a_coverage_vector_only_when_coverage_is_not_required():
    reports = {"a": Report(True, False), "b": Report(True, False)}
    assert decide_commit(["a", "b"], ["a", "b"], reports)[0] is Verdict.ABORT
    assert decide_commit(["a", "b"], ["a", "b"], reports, require_coverage=False)[0] is Verdict.COMMIT


def test_a_restarted_coordinator_waits_for_the_last_commits_members_before_redoing_it():
    # the floor says step 5 was committed by a, b, c; only d (one step behind) is back yet
    view = QuorumView(cluster_step=4, current_id=0, current_members=(), current_intact=False, checkpoint_step=-1,
                      max_id_seen=7, awaiting_holders=("a", "b", "c"))
    d = decide_quorum(1.0, [m("d")], view, CFG)
    assert d.action is Action.WAIT and "a, b, c" in d.reason and "reconnect" in d.reason
    # once they are back (none holds step 5) the coordinator clears awaiting_holders: step 5 is redone
    back = decide_quorum(1.0, [m(w) for w in "abcd"], QuorumView(4, 0, (), False, -1, "", 7), CFG)
    assert back.action is Action.FORM and back.step == 5 and back.quorum_id == 8
