import pytest

from phalanx.membership.failure_detector import (
    DetectorConfig, Liveness, Phase, heartbeat_suspects, progress_suspects,
)

CFG = DetectorConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.6, progress_timeout_s=2.0)


@pytest.mark.parametrize("now, live, suspects", [
    (10.0, {"a": Liveness(True, 9.9), "b": Liveness(True, 9.5)}, []),
    (10.0, {"a": Liveness(True, 9.9), "b": Liveness(True, 9.3)}, ["b"]),  # stopped heartbeating (SIGSTOP, GIL)
    (10.0, {"a": Liveness(False, 9.99)}, ["a"]),  # connection dropped (SIGKILL)
    (10.0, {}, []),
])
def test_heartbeat_timeouts(now, live, suspects):
    assert [s.worker_id for s in heartbeat_suspects(now, live, CFG)] == suspects


def test_no_false_suspicion_from_jittery_but_regular_heartbeats():
    last = 0.0
    for i in range(1, 200):
        now = i * 0.1
        if i % 5:  # 4 of 5 heartbeats arrive, late by up to 0.3 s
            last = now - 0.3 * ((i * 7) % 3) / 2
        assert heartbeat_suspects(now, {"a": Liveness(True, last)}, CFG) == []


@pytest.mark.parametrize("now, phases, suspects", [
    (5.0, {"a": (Phase.ALLREDUCE, 4.0), "b": (Phase.ASSIGNED, 3.9)}, []),  # normal skew
    (6.5, {"a": (Phase.ALLREDUCE, 4.0), "b": (Phase.ASSIGNED, 3.9), "c": (Phase.ALLREDUCE, 4.1)}, ["b"]),
    (9.0, {"a": (Phase.REPORTED, 4.0), "b": (Phase.ALLREDUCE, 3.0)}, ["b"]),  # stuck inside the collective
    (9.0, {"a": (Phase.ALLREDUCE, 4.0)}, []),  # alone: nobody to compare with
    (9.0, {"a": (Phase.ALLREDUCE, 4.0), "b": (Phase.ALLREDUCE, 4.0)}, []),  # together, even if slow
])
def test_progress_watch_catches_members_left_behind(now, phases, suspects):
    assert [s.worker_id for s in progress_suspects(now, phases, CFG)] == suspects
