"""The step engine (train/step_engine.py) in virtual time: the paths that only real runs used to
take (restore from a durable checkpoint, local-sgd, the end of the job) now run in the simulator
through the very same code."""

from phalanx.core.modes import ConsistencyMode, ModeConfig
from phalanx.sim.scenario import Scenario

LOCAL_SGD = ModeConfig(mode=ConsistencyMode.LOCAL_SGD, sync_every_steps=5, max_staleness_steps=10)


def _spans(r, name, worker=None):
    return [s for s in r.spans if s["span"] == name and (worker is None or s["node"] == worker)]


def test_workers_restore_the_newest_checkpoint_when_every_holder_of_the_state_died():
    # both workers die in the middle of step 10 (steps take ~50 ms; at_s counts from the first
    # commit, ~0.05 s, and step 9 commits at ~0.51 s), after the checkpoint of step 9; the
    # restarted processes hold nothing, so they restore that (in-memory, durable) checkpoint and
    # go on to the reference
    r = (Scenario(workers=2, seed=3, checkpoint_every_steps=5)
         .crash(0, at_s=0.48).crash(1, at_s=0.48).run_until(step=30))
    assert r.ok, r.reason
    restores = _spans(r, "restore")
    assert restores and {s["step"] for s in restores} == {9}
    assert r.summary["reference_max_abs_diff"] is not None and r.summary["reference_max_abs_diff"] <= 1e-9


def test_local_sgd_runs_in_the_simulator_and_every_merge_leaves_members_identical():
    r = Scenario(workers=4, seed=1, modes=LOCAL_SGD).run_until(step=30)
    assert r.ok and not r.violations, r.reason  # the checker compares digests after each merge
    assert [c["step"] for c in r.commits] == list(range(7))  # merges at local steps 0, 5, ..., 30
    merged = _spans(r, "merged", "w0")
    assert [s["step"] for s in merged] == [0, 5, 10, 15, 20, 25, 30]
    assert r.summary["reference_max_abs_diff"] > 0  # local steps are not the reference's global steps


def test_local_sgd_keeps_its_staleness_bound_through_a_partition_in_the_simulator():
    r = (Scenario(workers=4, seed=2, modes=LOCAL_SGD)
         .partition([0, 1], [2, 3], at_step=2, for_s=1.0).run_until(step=40))
    assert r.ok, r.reason
    staleness = [s["staleness"] for s in r.spans if s["span"] == "local_step"]
    assert staleness and max(staleness) <= 10


def test_a_worker_frozen_across_the_end_is_caught_up_by_a_draining_peer_in_the_simulator():
    r = Scenario(workers=3, seed=5).freeze(2, at_step=28, for_s=2.0).run_until(step=30)
    assert r.ok, r.reason
    caught = r.events_of("caught_up_after_finish")
    assert caught and "w2" in caught[0]["members"]
    assert r.summary["workers_completed"] == 3  # w2 ended holding the final state too


def test_fault_free_steps_ask_for_the_next_quorum_in_their_report():
    # the fast path: with unchanged membership a worker's report of step s is also its request for
    # step s+1, and the grant follows the commit decision: no QuorumRequest round trip per step
    r = Scenario(workers=4, seed=5).run_until(step=30)
    assert r.ok, r.reason
    asked = r.summary["quorum_requests"]
    assert asked["in_reports"] == 4 * 29  # every step after the first, every worker
    assert asked["sent"] == 4  # the first step's requests only


def test_a_checkpoint_writer_asks_the_normal_way_and_its_peers_wait_for_it():
    r = Scenario(workers=4, seed=5, checkpoint_every_steps=10).run_until(step=30)
    assert r.ok, r.reason
    asked = r.summary["quorum_requests"]
    written = sorted(s["step"] for s in _spans(r, "checkpoint"))
    assert written == [9, 19, 29]
    # the writer of steps 9 and 19 asked for 10 and 20 once written (29 is the last step)
    assert asked["sent"] == 4 + 2 and asked["in_reports"] == 4 * 29 - 2


def test_a_stepping_worker_sends_no_heartbeats_and_a_silent_one_does(monkeypatch):
    # any message is a sign of life to the coordinator, so heartbeats only fill silences: a worker
    # stepping every ~50 ms sends its progress marks and reports instead; one hung inside its step
    # (heartbeats must keep flowing, or the progress watch could not tell it from a dead one) sends
    # them again
    from phalanx.core.messages import Heartbeat
    from phalanx.sim.connection import SimConnection

    sent: list[tuple[str, float]] = []
    original = SimConnection.send

    async def counting(self, message, buffers=()):
        if isinstance(message, Heartbeat):
            sent.append((self.local.name, self._loop.time()))
        return await original(self, message, buffers)

    monkeypatch.setattr(SimConnection, "send", counting)
    r = Scenario(workers=4, seed=5).run_until(step=30)
    assert r.ok, r.reason
    assert len(sent) <= 4 * 3, sent  # 120 worker-steps: at most a few around the first quorum and the end
    sent.clear()
    r = Scenario(workers=3, seed=2).hang(1, at_step=5, for_s=3.0).run_until(step=20)
    assert r.ok, r.reason
    assert sum(1 for node, _ in sent if node == "w1") >= 15  # 3 s hung: heartbeats every ~0.1 s
    assert not [e for e in r.events_of("worker_suspected") if e["reason"].startswith("no heartbeat")]


def test_the_coordinator_never_goes_two_heartbeat_intervals_without_a_message(monkeypatch):
    # heartbeats fill silences only: whatever a worker is doing (stepping, hung inside a step with
    # its heartbeats flowing, waiting in a long all-reduce behind the hung one), the coordinator
    # hears from it at least every 2 intervals (0.2 s; the timeout is 0.6 s)
    from phalanx.sim.connection import SimConnection

    sent: dict[str, list[float]] = {}
    original = SimConnection.send

    async def recording(self, message, buffers=()):
        if self.remote.name == "coordinator":
            sent.setdefault(self.local.name, []).append(self._loop.time())
        return await original(self, message, buffers)

    monkeypatch.setattr(SimConnection, "send", recording)
    r = Scenario(workers=3, seed=2).hang(1, at_step=5, for_s=3.0).run_until(step=20)
    assert r.ok, r.reason
    assert sorted(sent) == ["w0", "w1", "w2"]
    for node, times in sent.items():
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert max(gaps) <= 0.2 + 1e-6, (node, max(gaps))
        assert max(gaps) > 0.1, node  # a 3 s hang (and the all-reduce waiting on it) has silences to fill
