"""One fault plan means the same on a real run and in the simulator: ``at_s`` counts from the
first committed step on both (faults/timeline.py), so the fault lands at the same point of the run
although a real run spends seconds starting processes that the simulator starts at once."""

from phalanx.faults.plan import parse_fault_plan
from phalanx.sim.cluster import Cluster
from phalanx.sim.scenario import Scenario
from tests.integration.conftest import events, train

PLAN = '[[fault]]\nkind = "freeze"\nworker = 2\nat_s = 1.5\nfor_s = 1.0\n'
STEP_S = 0.1  # paced real steps; the simulator's compute per step


def _injected_at_step(evs):
    return next(e["at_step"] for e in evs if e["event"] == "fault_injected")


def test_at_s_lands_at_the_same_step_on_a_real_run_and_in_the_simulator(tmp_path):
    real = train(tmp_path, PLAN, workers=3, steps=40, min_step_s=STEP_S)
    assert real["ok"], real.get("reason")
    real_step = _injected_at_step(events(tmp_path / "run"))
    sim = Cluster(workers=3, steps=40, seed=1, plan=parse_fault_plan(PLAN, "<test>"), step_compute_s=STEP_S).run()
    assert sim.ok, sim.reason
    sim_step = _injected_at_step(sim.events)
    # 1.5 s of ~0.1 s steps after the first commit: step ~15 on both (the real step carries a few
    # ms of control overhead, so it may land a step or two earlier); counted from the process
    # start, the real run would have landed it within its first steps
    assert 10 <= real_step <= 17 and 10 <= sim_step <= 17, (real_step, sim_step)
    assert abs(real_step - sim_step) <= 3, (real_step, sim_step)


def test_in_the_simulator_at_s_is_exactly_that_long_after_the_first_commit():
    r = Scenario(workers=3, seed=4).freeze(1, at_s=0.5, for_s=0.2).run_until(step=20)
    first = r.first("step_committed")["t"]
    injected = r.first("fault_injected")["t"]
    assert abs((injected - first) - 0.5) < 1e-9
