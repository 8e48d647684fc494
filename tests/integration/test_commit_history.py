"""Real processes with the coordinator's in-memory commit history cut to a few records: the full
history is RUN/commits.jsonl, and everything read at the end of the run (metrics.jsonl, the
exactly-once tally, the summary) comes from it, the same as from the whole list. Across a
coordinator kill and a resumed launch the log stays gap-free and duplicate-free."""

import json

import pytest

from phalanx.membership.commit_log import commit_json, read_commits, read_log, read_superseded
from tests.integration.conftest import assert_strict, events, train

KEPT = 4  # far fewer than the steps: every end-of-run reader must go to the log
PACE = {"min_step_s": 0.08}  # as test_coordinator_kill: steps still running when the coordinator comes back


def _metrics_lines(run_dir):
    return (run_dir / "metrics.jsonl").read_text().splitlines()


def _decisions(run_dir):
    """(step, quorum_id) of every commit decision, from the coordinator's own events (an independent record)."""
    return [(e["step"], e["quorum_id"]) for e in events(run_dir)
            if e["event"] == "step_committed" and e.get("node") == "coordinator"]


def test_a_run_keeping_four_commits_in_memory_reports_from_the_full_log_on_disk(tmp_path):
    s = train(tmp_path, workers=3, steps=30, commits_kept=KEPT)
    assert_strict(s)
    run = tmp_path / "run"
    logged = list(read_log(run / "commits.jsonl"))
    assert [r.step for _, _, r in logged] == list(range(30)) and {inc for inc, _, _ in logged} == {0}
    # metrics.jsonl is the log's records, as the in-memory list printed them, line for line
    assert _metrics_lines(run) == [json.dumps(commit_json(c)) for c in read_commits(run / "commits.jsonl")]
    assert [(r.step, r.quorum_id) for _, _, r in logged] == _decisions(run)
    by_event = {e["step"]: e for e in events(run) if e["event"] == "step_committed"}
    assert all(r.loss == by_event[r.step]["loss"] and list(r.members) == by_event[r.step]["members"]
               for _, _, r in logged)
    assert s["steps_committed"] == 30 and s["final_loss"] == logged[-1][2].loss
    assert s["mode_metrics"]["samples_trained"] == 30 * 32 and s["mode_metrics"]["throughput_samples_per_s"]


def test_a_coordinator_kill_keeps_appending_to_one_log_without_a_gap_or_a_duplicate(tmp_path):
    plan = '[[fault]]\nkind = "coordinator_kill"\nat_step = 10\nrestart_after_s = 1.0\n'
    s = train(tmp_path, plan, workers=3, steps=40, checkpoint_every_steps=5, commits_kept=KEPT, **PACE)
    assert_strict(s)
    run = tmp_path / "run"
    logged = list(read_log(run / "commits.jsonl"))
    # every decision either incarnation made is one line, in order, tagged with its incarnation
    assert [(r.step, r.quorum_id) for _, _, r in logged] == _decisions(run)
    assert {inc for inc, _, _ in logged} == {0, 1}
    first = [r.step for inc, _, r in logged if inc == 0]
    second = [r.step for inc, _, r in logged if inc == 1]
    assert first == list(range(len(first))) and second == list(range(second[0], 40))
    assert second[0] in (first[-1], first[-1] + 1)  # continues, or redoes one decision no worker heard
    merged = [c.step for c in read_commits(run / "commits.jsonl")]
    superseded = list(read_superseded(run / "commits.jsonl"))
    assert merged == list(range(40)) and len(logged) == 40 + len(superseded)
    assert [e["step"] for e in events(run) if e["event"] == "commit_superseded"] == [c.step for c in superseded]
    assert _metrics_lines(run) == [json.dumps(commit_json(c)) for c in read_commits(run / "commits.jsonl")]
    times = [c.committed_at_s for c in read_commits(run / "commits.jsonl")]
    assert times == sorted(times), "the second incarnation's commit times are on the first's clock"


@pytest.mark.slow
def test_a_resumed_launch_appends_to_the_log_and_the_merged_log_is_the_runs_metrics(tmp_path):
    plan = "".join(f'[[fault]]\nkind = "kill"\nworker = {w}\nat_step = 25\nrestart = false\n' for w in range(3))
    first = train(tmp_path, plan, workers=3, steps=40, checkpoint_every_steps=10, name="job", commits_kept=KEPT)
    assert not first["ok"]
    run = tmp_path / "job"
    before = len(list(read_log(run / "commits.jsonl")))
    resumed = train(tmp_path, workers=3, steps=40, checkpoint_every_steps=10, name="job", resume=True,
                    commits_kept=KEPT)
    assert_strict(resumed)
    logged = list(read_log(run / "commits.jsonl"))
    assert len(logged) > before and {inc for inc, _, _ in logged} == {0, 1}
    # the second launch restarted from a checkpoint: the steps after it are superseded, each step once
    assert [c.step for c in read_commits(run / "commits.jsonl")] == list(range(40))
    assert _metrics_lines(run) == [json.dumps(commit_json(c)) for c in read_commits(run / "commits.jsonl")]
