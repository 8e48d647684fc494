"""The run report and trace, built from a hand-written run folder (no training, no processes)."""

import base64
import json
import re
from pathlib import Path

import pytest

from phalanx.cli.main import main
from phalanx.obs.report import compare_runs, fault_rows, load_run, read_jsonl, write_report
from phalanx.obs.trace import coordinator_offset_s, worker_pids

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DESCRIPTION = "freeze worker 1 for 0.3s at step 10 <b>&</b>"
WORKER_MONO0_S = 1000.0  # the workers' monotonic clock at coordinator t=1.0
STEPS = 20


def _jsonl(path: Path, records: list[dict], tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def _step_s(step: int) -> float:
    return 0.5 if step == 10 else 0.1


def _metrics() -> list[dict]:
    rows, t_s = [], 1.0
    for step in range(STEPS):
        t_s += _step_s(step)
        members = ["w0"] if step == 10 else ["w0", "w1"]
        rows.append({"step": step, "quorum_id": 2 if step >= 10 else 1, "members": members,
                     "loss": 4.0 - 0.1 * step, "step_s": _step_s(step), "committed_at_s": round(t_s, 6),
                     "samples_covered_once": True})
    return rows


def _events(metrics: list[dict]) -> list[dict]:
    fault_t_s = metrics[9]["committed_at_s"] + 0.01
    ev = [{"t": 0.0, "node": "coordinator", "event": "coordinator_started", "address": "127.0.0.1:1"},
          {"t": 0.9, "node": "coordinator", "event": "worker_joined", "worker": "w0"},
          {"t": 1.0, "node": "coordinator", "event": "quorum_formed", "quorum_id": 1, "step": 0,
           "members": ["w0", "w1"], "reason": "members ['w0', 'w1']"},
          {"t": 1.05, "node": "coordinator", "event": "some_future_event", "payload": [1, 2]}]
    for m in metrics:
        if m["step"] == 10:
            ev += [{"t": fault_t_s, "node": "coordinator", "event": "fault_injected", "kind": "freeze", "worker": "w1",
                    "at_step": 10, "description": DESCRIPTION},
                   {"t": fault_t_s + 0.2, "node": "coordinator", "event": "worker_suspected", "worker": "w1",
                    "reason": "heartbeat timeout"},
                   {"t": fault_t_s + 0.21, "node": "coordinator", "event": "step_aborted", "step": 10,
                    "quorum_id": 1, "reason": "w1 lost"},
                   {"t": fault_t_s + 0.22, "mono": WORKER_MONO0_S - 1.0 + fault_t_s + 0.22, "node": "launcher",
                    "event": "worker_exited", "worker": "w1", "exit_code": -9}]
        ev.append({"t": m["committed_at_s"], "node": "coordinator", "event": "step_committed", "step": m["step"],
                   "quorum_id": m["quorum_id"], "members": m["members"], "loss": m["loss"], "step_s": m["step_s"]})
    return ev


def _spans(worker: str, metrics: list[dict]) -> list[dict]:
    """quorum_wait 0.01 s, compute 0.08 s, allreduce the rest of the step, then a commit instant."""
    out = []
    for m in metrics:
        if worker not in m["members"]:
            continue
        start = WORKER_MONO0_S + m["committed_at_s"] - 1.0 - m["step_s"]
        out += [{"mono": start, "dur": 0.01, "node": worker, "span": "quorum_wait", "step": m["step"]},
                {"mono": start + 0.01, "dur": 0.08, "node": worker, "span": "compute", "step": m["step"]},
                {"mono": start + 0.09, "dur": m["step_s"] - 0.09, "node": worker, "span": "allreduce",
                 "step": m["step"]},
                {"mono": start + m["step_s"], "node": worker, "event": "committed", "step": m["step"]}]
    if worker == "w1":
        out.append({"mono": out[-1]["mono"] + 0.001, "dur": 0.02, "node": "w1", "span": "heal", "step": 11})
    return out


def make_run(root: Path, name: str = "run", *, faulty: bool = True) -> Path:
    run = root / name
    metrics = _metrics()
    _jsonl(run / "metrics.jsonl", metrics)
    _jsonl(run / "events.jsonl", _events(metrics))
    _jsonl(run / "workers" / "w0.jsonl", _spans("w0", metrics))
    _jsonl(run / "workers" / "w1.jsonl", _spans("w1", metrics), tail='{"mono": 1003.1, "dur": 0.0')  # SIGKILLed
    summary = {"ok": True, "reason": "all workers finished", "workers": 2, "steps": STEPS, "steps_committed": STEPS,
               "steps_retried": 1, "samples_exactly_once": True, "final_loss": 2.1, "reference_final_loss": 2.1,
               "reference_max_abs_diff": 0.0, "wall_s": 4.2, "false_suspicions": 0,
               "control_plane": {"bytes_sent": 20_000, "frames_sent": 200, "bytes_received": 30_000,
                                 "frames_received": 400, "rejected": {"bad_hmac": 1}},
               "faults": [{"kind": "freeze", "worker": 1, "at_step": 10, "description": DESCRIPTION,
                           "detected_after_s": 0.2, "recovered_after_s": 0.3, "ended_after_s": 0.3}] if faulty else []}
    (run / "summary.json").write_text(json.dumps(summary))
    return run


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    return make_run(tmp_path)


def _pngs(text: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", text)]


def test_report_is_self_contained_with_every_plot(run_dir: Path) -> None:
    res = write_report(run_dir)
    assert res["report"] == run_dir / "report.html" and res["trace"] == run_dir / "trace.json"
    text = res["report"].read_text()
    assert text.count("data:image/png;base64,") == len(res["plots"]) == 3
    assert all(png.startswith(PNG_SIGNATURE) for png in _pngs(text))
    assert "http://" not in text and "https://" not in text and "<script" not in text
    assert "<link" not in text and "<style>" in text
    assert "freeze worker 1 for 0.3s at step 10 &lt;b&gt;&amp;&lt;/b&gt;" in text  # escaped, present
    assert "<b>&</b>" not in text
    assert "bad_hmac" in text and '<td class="num">1000</td>' in text  # 20 000 bytes sent over 20 steps


def test_fault_detection_and_recovery_come_from_the_event_log(run_dir: Path) -> None:
    [row] = fault_rows(load_run(run_dir))
    assert (row.kind, row.worker, row.at_step) == ("freeze", "w1", 10)
    assert row.detected_after_s == pytest.approx(0.2)
    assert row.recovered_after_s == pytest.approx(0.5 - 0.01)  # step 10 committed after the frozen stretch
    assert row.ended_after_s == pytest.approx(0.3) and row.steps_aborted == 1


def test_truncated_last_line_is_skipped(run_dir: Path) -> None:
    recs = read_jsonl(run_dir / "workers" / "w1.jsonl")
    assert recs and recs[-1]["span"] == "heal"


def test_trace_has_a_track_per_worker_with_microsecond_spans(run_dir: Path) -> None:
    write_report(run_dir)
    trace = json.loads((run_dir / "trace.json").read_text())
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "coordinator", 1: "w0", 2: "w1"}
    assert {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"} >= {"launcher"}
    for pid, worker in ((1, "w0"), (2, "w1")):
        compute = [e for e in events if e["ph"] == "X" and e["pid"] == pid and e["name"] == "compute"]
        expected = [m for m in _metrics() if worker in m["members"]]
        assert [e["args"]["step"] for e in compute] == [m["step"] for m in expected]
        assert all(a["ts"] < b["ts"] for a, b in zip(compute, compute[1:]))
        assert all(e["dur"] == 80000 for e in compute)
    assert min(e["ts"] for e in events if "ts" in e) == 0
    assert any(e["ph"] == "i" and e["pid"] == 1 and e["name"] == "committed" for e in events)


def test_coordinator_events_share_the_worker_time_axis(run_dir: Path) -> None:
    write_report(run_dir)
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    coord = {e["name"]: e for e in events if e["pid"] == 0 and e["ph"] == "i"}
    assert {"quorum_formed", "fault_injected", "worker_suspected", "step_aborted", "some_future_event"} <= set(coord)
    assert coord["fault_injected"]["args"]["description"] == DESCRIPTION
    # the launcher's event carries both clocks: coordinator t=1.0 is worker mono 1000.0, and t=0 is the origin
    fault_t_s = _metrics()[9]["committed_at_s"] + 0.01
    assert coord["fault_injected"]["ts"] == pytest.approx(fault_t_s * 1e6, abs=1)
    first_w0 = min(e["ts"] for e in events if e["pid"] == 1 and e["ph"] == "X")
    assert first_w0 == pytest.approx(1.0 * 1e6, abs=1)
    commits = [e for e in events if e["pid"] == 0 and e["ph"] == "X"]
    assert len(commits) == STEPS and commits[10]["dur"] == pytest.approx(0.5e6, abs=1)


def test_clock_alignment_falls_back_to_the_earliest_worker_instant() -> None:
    events = [{"t": 0.0, "event": "coordinator_started"}, {"t": 2.0, "event": "quorum_formed"}]
    assert coordinator_offset_s(events, {"w0": [{"mono": 50.0}, {"mono": 49.0}]}) == 49.0
    assert coordinator_offset_s(events, {}) == 0.0
    assert worker_pids(["w1", "w0", "extra", "w10"]) == {"w0": 1, "w1": 2, "w10": 11, "extra": 12}


def test_a_bare_run_folder_still_reports(tmp_path: Path) -> None:
    run = tmp_path / "bare"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    (run / "events.jsonl").write_text("not json\n")
    res = write_report(run)
    assert len(_pngs(res["report"].read_text())) == 3
    assert json.loads(res["trace"].read_text())["traceEvents"][0]["ph"] == "M"


def test_compare_runs_tables_both_with_ratios(tmp_path: Path) -> None:
    a, b = make_run(tmp_path, "a"), make_run(tmp_path, "b", faulty=False)
    out = compare_runs(a, b)
    assert out == b / "compare.html"
    text = out.read_text()
    assert len(_pngs(text)) == 2 and "B / A" in text and "median step (s)" in text
    assert "https://" not in text and "<script" not in text
    assert compare_runs(a, b, tmp_path / "c.html") == tmp_path / "c.html"


def test_cli_report_and_compare(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(run_dir)]) == 0
    assert str(run_dir / "report.html") in capsys.readouterr().out
    other = make_run(tmp_path, "other")
    assert main(["report", str(run_dir), str(other), "--out", str(tmp_path / "cmp.html")]) == 0
    assert (tmp_path / "cmp.html").is_file()


def test_cli_refuses_what_is_not_a_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no such run folder" in capsys.readouterr().err
    half = tmp_path / "half"
    half.mkdir()
    (half / "metrics.jsonl").write_text("")
    assert main(["report", str(half)]) == 2
    assert "events.jsonl: missing" in capsys.readouterr().err
