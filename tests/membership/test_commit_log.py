"""The commit history: the coordinator keeps a bounded ring, the full log is on disk and reads back
merged (a decision redone by a later incarnation supersedes the dead one's), and a malformed log
line is a typed error naming the file and the line."""

import json
import math

import pytest

from phalanx.core.errors import PhalanxError
from phalanx.membership.commit_log import (
    CommitHistory, CommitLogError, CommitLogWriter, CommitRecord, commit_json, merge_commits, read_commits,
    read_log, read_superseded,
)
from phalanx.sim.scenario import Scenario


def _c(step: int, qid: int, at_s: float = 0.0, loss: float = 0.5) -> CommitRecord:
    return CommitRecord(step, qid, ("w0", "w1"), loss, at_s, 0.01, True)


def _write(path, incarnations, shifts=None):
    log = CommitLogWriter(path)
    for i, recs in enumerate(incarnations):
        sink = log.incarnation(shifts[i] if shifts else 0.0)
        for r in recs:
            sink(r)
    log.close()
    return log


def test_the_log_reads_back_every_record_as_written(tmp_path):
    recs = [_c(i, 1, at_s=0.1 * i, loss=1.0 / (i + 1)) for i in range(50)]
    _write(tmp_path / "c.jsonl", [recs])
    assert list(read_commits(tmp_path / "c.jsonl")) == recs
    assert len((tmp_path / "c.jsonl").read_text().splitlines()) == 50


def test_the_merged_log_equals_the_in_memory_merge_and_lists_the_redone_decision_as_superseded(tmp_path):
    incarnations = [[_c(0, 1), _c(1, 1), _c(2, 1)], [], [_c(2, 3), _c(3, 3)], [_c(4, 5)]]
    _write(tmp_path / "c.jsonl", incarnations)
    merged, superseded = merge_commits(incarnations)
    assert list(read_commits(tmp_path / "c.jsonl")) == merged
    assert list(read_superseded(tmp_path / "c.jsonl")) == superseded == [_c(2, 1)]
    # nothing lost, nothing written twice: every decision is one line, tagged with its incarnation
    assert [(inc, r.step) for inc, _, r in read_log(tmp_path / "c.jsonl")] == [
        (0, 0), (0, 1), (0, 2), (2, 2), (2, 3), (3, 4)]


def test_a_later_incarnation_writes_its_commit_times_on_the_first_incarnations_clock(tmp_path):
    _write(tmp_path / "c.jsonl", [[_c(0, 1, at_s=0.5)], [_c(1, 2, at_s=0.25)]], shifts=[0.0, 2.0])
    assert [c.committed_at_s for c in read_commits(tmp_path / "c.jsonl")] == [0.5, 2.25]


def test_a_resumed_launch_appends_new_incarnations_and_its_history_starts_at_them(tmp_path):
    path = tmp_path / "c.jsonl"
    _write(path, [[_c(0, 1), _c(1, 1), _c(2, 1)]])
    log = CommitLogWriter(path, append=True)
    assert log.first_incarnation == 1
    sink = log.incarnation()
    sink(_c(2, 4))  # resumed from the checkpoint of step 1: step 2 redone
    sink(_c(3, 4))
    log.close()
    assert [(c.step, c.quorum_id) for c in log.history()] == [(2, 4), (3, 4)]
    assert [(c.step, c.quorum_id) for c in read_commits(path)] == [(0, 1), (1, 1), (2, 4), (3, 4)]


def test_the_history_answers_len_last_and_slices_like_the_list_it_replaces(tmp_path):
    recs = [_c(i, 1) for i in range(10)]
    _write(tmp_path / "c.jsonl", [recs])
    h = CommitHistory(tmp_path / "c.jsonl")
    assert len(h) == 10 and h and h[-1] == recs[-1] and h[3] == recs[3] and h[5:] == recs[5:]
    assert h[-3:] == recs[-3:] and list(h) == recs
    with pytest.raises(IndexError):
        h[10]
    assert not CommitHistory(tmp_path / "missing.jsonl") and list(CommitHistory(tmp_path / "missing.jsonl")) == []


def test_a_nan_loss_is_recorded_and_read_back(tmp_path):
    _write(tmp_path / "c.jsonl", [[_c(0, 1, loss=float("nan"))]])
    assert math.isnan(next(read_commits(tmp_path / "c.jsonl")).loss)


GOOD = json.dumps({**commit_json(_c(0, 1)), "incarnation": 0})


@pytest.mark.parametrize("bad, problem", [
    ("{not json", "not a commit record"),
    ("[1, 2]", "Expected `object`, got `array`"),
    (json.dumps({**commit_json(_c(1, 1))}), "missing required field `incarnation`"),
    (json.dumps({**commit_json(_c(1, 1)), "incarnation": 0, "extra": 1}), "unknown field `extra`"),
    (json.dumps({**commit_json(_c(1, 1)), "incarnation": 0, "members": "w0"}), "at `$.members`"),
    (json.dumps({**commit_json(_c(1, 1)), "incarnation": 0, "step": "1"}), "Expected `int`, got `str` - at `$.step`"),
    (json.dumps({**commit_json(_c(1, 1)), "incarnation": 0, "step": -1}), "Expected `int` >= 0 - at `$.step`"),
    (json.dumps({**commit_json(_c(1, 1)), "incarnation": 0, "quorum_id": True}), "Expected `int`, got `bool` - at `$.quorum_id`"),
    (json.dumps({**commit_json(_c(1, 1)), "incarnation": 0, "loss": "x"}), "at `$.loss`"),
    (json.dumps({**commit_json(_c(1, 1)), "incarnation": 0, "samples_covered_once": 1}), "Expected `bool`, got `int`"),
    (json.dumps({**commit_json(_c(1, 1)), "incarnation": 0}).replace('"step_s": 0.01', '"step_s": 1e999'), "Number out of range - at `$.step_s`"),
    (json.dumps({**commit_json(_c(3, 1)), "incarnation": 0}), "step 3 after step 0 in incarnation 0"),
])
def test_a_malformed_log_line_is_a_typed_error_naming_the_file_and_line(tmp_path, bad, problem):
    path = tmp_path / "commits.jsonl"
    path.write_text(GOOD + "\n\n" + bad + "\n" + GOOD + "\n")
    with pytest.raises(CommitLogError) as e:
        list(read_commits(path))
    assert isinstance(e.value, PhalanxError) and e.value.line == 3 and e.value.path == str(path)
    assert f"{path}:3:" in str(e.value) and problem in str(e.value)


def test_an_incarnation_going_back_and_a_cut_short_last_line_are_typed_errors(tmp_path):
    path = tmp_path / "commits.jsonl"
    path.write_text(json.dumps({**commit_json(_c(0, 1)), "incarnation": 1}) + "\n" + GOOD + "\n")
    with pytest.raises(CommitLogError, match=r":2: incarnation 0 after incarnation 1"):
        list(read_commits(path))
    path.write_text(GOOD + "\n" + GOOD[:30])
    with pytest.raises(CommitLogError, match=r":2: the last record is cut short"):
        len(CommitHistory(path))


def test_a_log_that_cannot_be_read_back_is_not_appended_to(tmp_path):
    path = tmp_path / "commits.jsonl"
    path.write_text("garbage\n")
    with pytest.raises(CommitLogError, match=":1:"):
        CommitLogWriter(path, append=True)
    assert path.read_text() == "garbage\n"


# ---- the coordinator's ring and its sink, on the simulated cluster ----
def test_the_coordinator_keeps_the_last_n_commits_in_memory_while_the_log_holds_every_one(tmp_path):
    scenario = Scenario(workers=2, seed=5, commits_kept=8, commit_log=str(tmp_path / "commits.jsonl"))
    cluster = scenario.cluster_for(60)
    r = cluster.run()
    assert r.ok, r.reason
    assert len(cluster.coord.commits) == 8 and cluster.coord.commits_total == 60
    assert [c.step for c in cluster.coord.commits] == list(range(52, 60))
    assert [c.step for c in read_commits(tmp_path / "commits.jsonl")] == list(range(60))
    # the results are what an unbounded, in-memory history gives
    ref = Scenario(workers=2, seed=5, commits_kept=10**6).run_until(step=60)
    assert r.commits == ref.commits and r.digest == ref.digest and r.summary["samples_exactly_once"]


def test_a_decision_redone_after_a_coordinator_kill_reads_back_from_the_log_as_in_memory(tmp_path):
    # the scenario of tests/sim/test_scenario.py: kill the coordinator 50 us after it decides step
    # 12, so no worker applies it and the next incarnation commits step 12 again
    base = Scenario(workers=4, seed=3).run_until(step=30)
    decided = next(c["committed_at_s"] for c in base.commits if c["step"] == 12)
    at_s = decided - base.commits[0]["committed_at_s"] + 50e-6
    mem = Scenario(workers=4, seed=3).kill_coordinator(at_s=at_s).run_until(step=30)
    disk = Scenario(workers=4, seed=3, commits_kept=4,
                    commit_log=str(tmp_path / "commits.jsonl")).kill_coordinator(at_s=at_s).run_until(step=30)
    assert [c["step"] for c in mem.superseded] == [12]
    assert disk.commits == mem.commits and disk.superseded == mem.superseded and disk.ok
    lines = list(read_log(tmp_path / "commits.jsonl"))
    assert len(lines) == 31 and {inc for inc, _, _ in lines} == {0, 1}  # 30 steps + the one redone


def test_a_history_outlives_its_run_folder_and_reads_the_same_with_small_reads(tmp_path, monkeypatch):
    import phalanx.membership.commit_log as cl

    recs = [_c(i, 1, loss=0.1 * i) for i in range(200)]
    _write(tmp_path / "c.jsonl", [recs[:120], recs[119:]])  # the second incarnation redoes step 119
    monkeypatch.setattr(cl, "_CHUNK_BYTES", 100)  # lines split across reads
    h = CommitHistory(tmp_path / "c.jsonl")
    (tmp_path / "c.jsonl").unlink()  # e.g. a benchmark's temporary run folder, removed before it reads
    assert list(h) == recs and len(h) == 200 and h[-1] == recs[-1] and h.superseded() == [recs[119]]
    assert [c.step for c in h[5:8]] == [5, 6, 7]
    h.close()


def test_a_line_that_is_not_utf8_is_a_typed_error(tmp_path):
    path = tmp_path / "commits.jsonl"
    path.write_bytes(GOOD.encode() + b"\n\xff\xfe\n")
    with pytest.raises(CommitLogError, match=":2: not a commit record"):
        list(CommitHistory(path))
