"""A kill's detection in the simulator: the killed process's connections close ``process_exit_s``
after the kill (the OS's teardown, which bench/fidelity.py's probe measures), and the coordinator
suspects the worker once it reads its connection closed, as on a real run."""

from __future__ import annotations

from phalanx.faults.plan import parse_fault_plan
from phalanx.sim.cluster import Cluster
from phalanx.sim.network import LinkModel

TWO_KILLS = ('[[fault]]\nkind = "kill"\nworker = 1\nat_step = 5\nrestart = true\n'
             '[[fault]]\nkind = "kill"\nworker = 2\nat_step = 40\nrestart = true\n')


def _run(**kw: object) -> object:
    return Cluster(workers=3, steps=80, seed=3, plan=parse_fault_plan(TWO_KILLS, "<t>"),  # type: ignore[arg-type]
                   link=LinkModel(latency_s=0.001, jitter_s=0.0), **kw).run()


def _detections_s(r: object) -> list[float]:
    return [f["detected_after_s"] for f in r.summary["faults"] if f["kind"] == "kill"]  # type: ignore[attr-defined]


def test_a_kill_is_detected_process_exit_s_later_than_with_an_instant_teardown() -> None:
    instant, slow = _run(), _run(process_exit_s=0.04)
    assert instant.ok and slow.ok  # type: ignore[attr-defined]
    fast_s, slow_s = _detections_s(instant), _detections_s(slow)
    assert len(fast_s) == len(slow_s) == 2
    assert all(d < 0.02 for d in fast_s), fast_s  # a control hop or so, no teardown
    for a, b in zip(fast_s, slow_s):
        assert 0.035 <= b - a <= 0.045, (fast_s, slow_s)  # the teardown is charged, once
    assert _run(process_exit_s=0.04).digest == slow.digest  # same seed, same run


def test_each_kill_takes_its_own_teardown_in_order_then_process_exit_s() -> None:
    """``process_exits_s``: the k-th kill's connections close after the k-th teardown (the fidelity
    benchmark passes the real run's own, as it does its restarts); past the list, ``process_exit_s``."""
    instant = _detections_s(_run())
    own = _detections_s(_run(process_exits_s=(0.01, 0.06), process_exit_s=0.5))
    past = _detections_s(_run(process_exits_s=(0.03,), process_exit_s=0.02))
    assert 0.005 <= own[0] - instant[0] <= 0.015 and 0.055 <= own[1] - instant[1] <= 0.065, (instant, own)
    assert 0.025 <= past[0] - instant[0] <= 0.035 and 0.015 <= past[1] - instant[1] <= 0.025, (instant, past)
