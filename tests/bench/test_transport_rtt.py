"""The transport benchmark measures both sides of real round trips between two processes."""

from phalanx.bench.transport_rtt import run_one


def test_each_kind_times_real_round_trips_and_both_sides_cpu():
    for kind in ("phalanx", "raw"):
        r = run_one(kind, 30, 0.0)
        assert 0 < r["rtt_us"] < 1e6
        assert r["client_cpu_us"] > 0 and r["server_cpu_us"] > 0
