import pytest

from phalanx.core.errors import FaultPlanError
from phalanx.faults.plan import FaultKind, default_plan_path, load_fault_plan, parse_fault_plan


def test_default_plan_parses_and_describes_each_fault():
    plan = load_fault_plan(default_plan_path())
    kinds = [f.kind for f in plan.faults]
    assert kinds == [FaultKind.KILL, FaultKind.FREEZE, FaultKind.GIL_HANG]
    assert all(f.line > 0 for f in plan.faults)
    plan.validate_workers(4)
    plan.require_supported("real")
    assert "kill worker 1" in plan.faults[0].describe()


@pytest.mark.parametrize("text, line, words", [
    ('[[fault]]\nkind = "explode"\nworker = 1\nat_step = 3\n', 2, "'kind' must be one of"),
    ('[[fault]]\nkind = "kill"\nat_step = 3\n', 1, "missing required key 'worker'"),
    ('[[fault]]\nkind = "kill"\nworker = 1\n', 1, "exactly one trigger"),
    ('[[fault]]\nkind = "freeze"\nworker = 1\nat_step = 3\nfor_s = -1\n', 5, "'for_s' must be a number > 0"),
    ('[[fault]]\nkind = "kill"\nworker = 1\nat_step = 3\ncolour = "red"\n', 5, "unknown key 'colour'"),
    ('\n\n[[fault]]\nkind = "kill"\nworker = "one"\nat_step = 3\n', 5, "'worker' must be an integer"),
    ('[[fault]\nkind = "kill"\n', 1, "not valid TOML"),
    ('[[fault]]\nkind = "loss"\nprobability = 1.5\nat_s = 1\n', 3, "'probability' must be in [0, 1)"),
])
def test_broken_plans_name_the_file_line_and_problem(text, line, words):
    with pytest.raises(FaultPlanError) as ei:
        parse_fault_plan(text, "plans/bad.toml")
    e = ei.value
    assert e.path == "plans/bad.toml" and e.line == line, str(e)
    assert words in e.problem
    assert str(e).startswith(f"plans/bad.toml:{line}: ")


def test_the_second_fault_reports_its_own_line():
    text = '[[fault]]\nkind = "kill"\nworker = 0\nat_step = 1\n\n[[fault]]\nkind = "hang"\nworker = 1\nat_step = 2\n'
    with pytest.raises(FaultPlanError) as ei:
        parse_fault_plan(text, "p.toml")
    assert ei.value.line == 6 and "fault #2 (hang): missing required key 'for_s'" in ei.value.problem


def test_worker_out_of_range_and_unsupported_kinds_are_rejected():
    plan = parse_fault_plan('[[fault]]\nkind = "kill"\nworker = 7\nat_step = 1\n', "p.toml")
    with pytest.raises(FaultPlanError, match=r"worker 7 \(in .worker.\) does not exist in a run of 4 workers"):
        plan.validate_workers(4)
    net = parse_fault_plan('[[fault]]\nkind = "duplicate"\nprobability = 0.1\nat_s = 1\n', "n.toml")
    net.require_supported("sim")
    with pytest.raises(FaultPlanError, match="not supported by the real runtime"):
        net.require_supported("real")


def test_unreadable_plan_file(tmp_path):
    with pytest.raises(FaultPlanError, match="cannot read the fault plan"):
        load_fault_plan(tmp_path / "missing.toml")


def test_join_names_a_worker_that_starts_later():
    plan = parse_fault_plan('[[fault]]\nkind = "join"\nworker = 3\nat_step = 10\n\n'
                            '[[fault]]\nkind = "kill"\nworker = 3\nat_step = 20\n', "p.toml")
    assert [f.kind for f in plan.faults] == [FaultKind.JOIN, FaultKind.KILL] and plan.joiners == {3}
    assert plan.faults[0].describe() == "join worker 3 at step 10"
    plan.validate_workers(4)
    plan.require_supported("real")
    plan.require_supported("sim")


@pytest.mark.parametrize("text, line, words", [
    ('[[fault]]\nkind = "join"\nat_step = 3\n', 1, "missing required key 'worker'"),
    ('[[fault]]\nkind = "join"\nworker = 1\nat_step = 3\nfor_s = 2\n', 5, "unknown key 'for_s'"),
    ('[[fault]]\nkind = "join"\nworker = 1\nat_step = 3\n\n[[fault]]\nkind = "join"\nworker = 1\nat_s = 9\n', 6,
     "fault #2 (join): worker 1 already joins in fault #1 (line 1); a worker joins only once"),
    ('[[fault]]\nkind = "freeze"\nworker = 1\nat_step = 2\nfor_s = 1\n\n[[fault]]\nkind = "join"\nworker = 1\n'
     'at_step = 5\n', 1, "worker 1 is not there yet: it joins at at_step = 5 (fault #2, line 7)"),
    ('[[fault]]\nkind = "join"\nworker = 1\nat_step = 5\n[[fault]]\nkind = "kill"\nworker = 1\nat_step = 5\n', 5,
     "trigger this fault after the join (at_step > 5)"),
    ('[[fault]]\nkind = "join"\nworker = 1\nat_s = 2.5\n[[fault]]\nkind = "hang"\nworker = 1\nat_step = 9\n'
     'for_s = 1\n', 5, "(at_s > 2.5)"),
])
def test_broken_joins_name_the_file_line_and_problem(text, line, words):
    with pytest.raises(FaultPlanError) as ei:
        parse_fault_plan(text, "plans/join.toml")
    assert ei.value.line == line and words in ei.value.problem, str(ei.value)
    assert str(ei.value).startswith(f"plans/join.toml:{line}: ")


def test_a_plan_where_every_worker_joins_later_is_rejected():
    plan = parse_fault_plan('[[fault]]\nkind = "join"\nworker = 0\nat_s = 1\n\n'
                            '[[fault]]\nkind = "join"\nworker = 1\nat_s = 1\n', "p.toml")
    plan.validate_workers(3)
    with pytest.raises(FaultPlanError, match=r"p.toml:6: .*every one of the 2 workers joins later"):
        plan.validate_workers(2)
