"""The fidelity benchmark's split of a real kill's detection: kill -> the coordinator reading the
connection closed (the OS's teardown) -> its suspicion (the protocol)."""

from phalanx.bench.fidelity import kill_detection_parts_s


def _ev(t, event, **kw):
    return {"t": t, "event": event, **kw}


def test_each_kill_is_split_at_its_own_workers_connection_lost_and_suspicion():
    events = [_ev(1.0, "fault_injected", kind="kill", worker="w1", at_step=30),
              _ev(1.02, "connection_lost", worker="w2"),  # another worker's: not this kill's
              _ev(1.05, "connection_lost", worker="w1"),
              _ev(1.0502, "worker_suspected", worker="w1"),
              _ev(2.0, "fault_injected", kind="freeze", worker="w2", at_step=70),  # not a kill
              _ev(2.6, "worker_suspected", worker="w2"),
              _ev(3.0, "fault_injected", kind="kill", worker="w3", at_step=110),
              _ev(3.04, "worker_suspected", worker="w3")]  # suspected before its connection was read
    parts = kill_detection_parts_s(events)
    assert [p["at_step"] for p in parts] == [30, 110]
    assert abs(parts[0]["to_connection_lost_s"] - 0.05) < 1e-9 and abs(parts[0]["to_suspected_s"] - 0.0502) < 1e-9
    assert parts[1]["to_connection_lost_s"] is None and abs(parts[1]["to_suspected_s"] - 0.04) < 1e-9


def test_each_kills_teardown_is_its_own_less_the_simulators_hop_or_the_probes():
    from phalanx.bench.fidelity import teardowns_s

    parts = [{"to_connection_lost_s": 0.030}, {"to_connection_lost_s": None}, {"to_connection_lost_s": 0.0005}]
    got = teardowns_s(parts, hop_s=0.001, fallback_s=0.025)  # type: ignore[arg-type]
    assert [round(x, 9) for x in got] == [0.029, 0.025, 0.0]
