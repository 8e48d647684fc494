"""One fault plan means the same on a real run and in the simulator: ``at_s`` counts from the
first committed step on both (faults/timeline.py), so the fault lands at the same point of the run
although a real run spends seconds starting processes that the simulator starts at once."""

from phalanx.faults.plan import parse_fault_plan
from phalanx.sim.cluster import Cluster
from phalanx.sim.scenario import Scenario
from tests.integration.conftest import events, train

PLAN = '[[fault]]\nkind = "freeze"\nworker = 2\nat_s = 1.5\nfor_s = 1.0\n'
STEP_S = 0.1  # paced real steps; the simulator's compute per step


def _offset_from_first_commit(evs):
    """(seconds from the first commit to the fault, the step that was next when it fired)."""
    first = next(e["t"] for e in evs if e["event"] == "step_committed")
    fault = next(e for e in evs if e["event"] == "fault_injected")
    return fault["t"] - first, fault["at_step"]


def test_at_s_lands_at_the_same_point_of_a_real_run_and_of_a_simulated_one(tmp_path):
    # A real run spends seconds starting processes before its first commit; the simulator none.
    # Counted from the first commit, the fault lands 1.5 s into the training on both (the real
    # injector polls, and a loaded machine may delay it a little).
    real = train(tmp_path, PLAN, workers=3, steps=40, min_step_s=STEP_S)
    assert real["ok"], real.get("reason")
    real_offset_s, real_step = _offset_from_first_commit(events(tmp_path / "run"))
    sim = Cluster(workers=3, steps=40, seed=1, plan=parse_fault_plan(PLAN, "<test>"), step_compute_s=STEP_S).run()
    assert sim.ok, sim.reason
    sim_offset_s, sim_step = _offset_from_first_commit(sim.events)
    assert abs(sim_offset_s - 1.5) < 1e-6, sim_offset_s
    assert 1.5 <= real_offset_s < 1.5 + 0.5, real_offset_s
    assert real_step >= 3 and sim_step >= 3  # well into the training, on both


def test_in_the_simulator_at_s_is_exactly_that_long_after_the_first_commit():
    r = Scenario(workers=3, seed=4).freeze(1, at_s=0.5, for_s=0.2).run_until(step=20)
    first = r.first("step_committed")["t"]
    injected = r.first("fault_injected")["t"]
    assert abs((injected - first) - 0.5) < 1e-9
