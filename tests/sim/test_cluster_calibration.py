"""The simulator's per-run calibration knobs that bench/fidelity.py sets from a real run."""

from __future__ import annotations

from phalanx.faults.plan import parse_fault_plan
from phalanx.sim.cluster import Cluster

TWO_KILLS = ('[[fault]]\nkind = "kill"\nworker = 1\nat_step = 5\nrestart = true\n'
             '[[fault]]\nkind = "kill"\nworker = 2\nat_step = 40\nrestart = true\n')


def _run(**kw: object) -> object:
    return Cluster(workers=3, steps=80, seed=3, plan=parse_fault_plan(TWO_KILLS, "<t>"), **kw).run()  # type: ignore[arg-type]


def _rejoin_after_kill_s(r: object) -> list[float]:
    out, killed_at = [], {}
    for e in r.events:  # type: ignore[attr-defined]
        if e["event"] == "fault_injected":
            killed_at[e["worker"]] = e["t"]
        elif e["event"] == "worker_joined" and e["worker"] in killed_at:
            out.append(e["t"] - killed_at.pop(e["worker"]))
    return out


def test_each_restart_takes_its_own_delay_in_order_then_the_default() -> None:
    r = _run(restart_delays_s=(0.5, 3.0), restart_delay_s=9.0)
    assert r.ok, r.reason  # type: ignore[attr-defined]
    first, second = _rejoin_after_kill_s(r)
    assert 0.5 <= first < 0.6 and 3.0 <= second < 3.1
    first, second = _rejoin_after_kill_s(_run(restart_delays_s=(0.5,), restart_delay_s=1.5))
    assert 0.5 <= first < 0.6 and 1.5 <= second < 1.6  # past the list: restart_delay_s


def test_a_healed_worker_spends_heal_load_s_loading_the_state() -> None:
    def heals(r: object) -> list[float]:
        return [s["dur"] for s in r.spans if s.get("span") == "heal"]  # type: ignore[attr-defined]

    plain, loaded = _run(), _run(heal_load_s=0.2)
    assert heals(plain) and all(h < 0.05 for h in heals(plain))
    assert len(heals(loaded)) == len(heals(plain)) and all(0.2 <= h < 0.25 for h in heals(loaded))
    assert _run(heal_load_s=0.2).digest == loaded.digest  # same seed, same run
