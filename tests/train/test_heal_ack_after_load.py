"""A heal is acknowledged to its source only once the target has loaded the state.

The source opens the quorum's process group as soon as every target has acked; the group's build
deadline (collective_timeout_s) then runs. If the ack came before the load, several joiners
loading a large state at once could outlast that deadline, and the step would abort and everyone
heal again (seen with three joiners loading 300 MB each on two cores). Run in the simulator, which
runs the real step engine and heal protocol with a load time of its own (heal_load_s).
"""

from __future__ import annotations

from phalanx.sim.cluster import Cluster


def _run(heal_load_s: float) -> object:
    # every worker but one starts without state and heals from the first at step 0
    return Cluster(workers=4, steps=12, seed=5, heal_load_s=heal_load_s, collective_timeout_s=1.0).run()


def test_joiners_loading_past_the_group_deadline_do_not_abort_the_step() -> None:
    r = _run(heal_load_s=1.5)  # each joiner loads for longer than the group may take to form
    assert r.ok, r.reason  # type: ignore[attr-defined]
    heals = [s for s in r.spans if s.get("span") == "heal"]  # type: ignore[attr-defined]
    assert len(heals) == 3 and all(h["dur"] >= 1.5 for h in heals)
    failed = [s for s in r.spans if s.get("span") == "allreduce" and not s["commit"]]  # type: ignore[attr-defined]
    assert not failed, failed[:3]  # no step aborted, and nobody healed a second time (3 heals)


def test_the_source_serves_until_its_targets_have_loaded() -> None:
    r = _run(heal_load_s=1.5)
    serve = [s for s in r.spans if s.get("span") == "heal_serve"]  # type: ignore[attr-defined]
    assert serve and all(s["dur"] >= 1.5 for s in serve)
