"""The fidelity benchmark's restart calibration: kill -> the same worker's next join, from events."""

from phalanx.bench.fidelity import rejoin_delays_s


def test_each_kill_is_paired_with_the_same_workers_next_join():
    events = [
        {"t": 1.0, "event": "worker_joined", "worker": "w1"},
        {"t": 5.0, "event": "fault_injected", "kind": "kill", "worker": "w1"},
        {"t": 5.5, "event": "worker_joined", "worker": "w2"},  # another worker: not its replacement
        {"t": 6.0, "event": "fault_injected", "kind": "freeze", "worker": "w2"},  # not a kill
        {"t": 7.25, "event": "worker_joined", "worker": "w1"},
        {"t": 9.0, "event": "fault_injected", "kind": "kill", "worker": "w3"},  # never came back: no pair
    ]
    assert rejoin_delays_s(events) == [2.25]
