"""A worker that is not there at the start (a `join` fault) joins a running real job: the first
quorum does not wait for it, it heals from a peer, and from then on every step includes it."""

import json

from tests.integration.conftest import assert_strict, events, train

# Paced steps (emulated compute) leave the joining process time to start, connect and heal while
# the job still runs, even on a loaded 2-core machine; the model and the reference are unchanged.
PACE = {"min_step_s": 0.08}


def test_a_worker_that_joins_at_step_8_heals_and_then_commits_every_step(tmp_path):
    plan = '[[fault]]\nkind = "join"\nworker = 2\nat_step = 8\n'
    s = train(tmp_path, plan, workers=3, steps=100, **PACE)
    assert_strict(s)
    assert "w2" in s["reference_max_abs_diff_per_worker"]  # it completed, with the reference parameters
    run = tmp_path / "run"
    evs = events(run)
    injected = next(e for e in evs if e["event"] == "fault_injected")
    assert injected["kind"] == "join" and injected["at_step"] >= 8
    joined = [e for e in evs if e["event"] == "worker_joined" and e["worker"] == "w2"]
    assert len(joined) == 1 and joined[0]["last_committed_step"] == -1  # one fresh process
    healed = [e for e in evs if e["event"] == "worker_healed" and e["worker"] == "w2"]
    assert len(healed) == 1 and healed[0]["source"] in ("w0", "w1") and healed[0]["step"] >= 8
    h = healed[0]["step"]
    commits = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [c["step"] for c in commits] == list(range(100))
    assert commits[0]["committed_at_s"] < 30.0  # the first quorum did not wait initial_wait_s for w2
    assert all(c["members"] == ["w0", "w1"] for c in commits[:h])
    assert h < 100 and all(c["members"] == ["w0", "w1", "w2"] for c in commits[h:])
    f = s["faults"][0]
    assert f["kind"] == "join" and f["detected_after_s"] is None and f["recovered_after_s"] is not None
