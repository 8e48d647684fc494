"""The coordinator's own process stops (SIGSTOP) for longer than the heartbeat timeout and then
goes on: the workers' heartbeats waited unread in its sockets meanwhile, so nobody is suspected,
no step aborts, and the stall itself is an event (``coordinator_late``). Before, the first tick
after the stall found every worker "silent" for the whole stall and aborted the step. (The sim
version, with every order of the thaw's timers: test_coordinator_alarm.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STOP_S = 1.5
TIMEOUT_S = 0.6  # the heartbeat timeout: the ticker sleeps up to about this long, so a tick due in
# the stall may come due up to that long after the stall began, and its lateness is the rest


def _events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def test_a_coordinator_stopped_for_longer_than_the_heartbeat_timeout_blames_no_worker(tmp_path: Path) -> None:
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "phalanx.cli.main", "train", "--workers", "2", "--steps", "60",
                          "--no-faults", "--quiet", "--no-reference", "--min-step-s", "0.05", "--out", str(run)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while sum(e["event"] == "step_committed" for e in _events(run / "events.jsonl")) < 10:
            assert p.poll() is None and time.monotonic() < deadline, "the run did not reach step 10"
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGSTOP)  # the launcher's process: the coordinator's event loop
        time.sleep(STOP_S)
        os.kill(p.pid, signal.SIGCONT)
        _, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err.decode()[-2000:]
    evs = _events(run / "events.jsonl")
    blamed = [e for e in evs if e["event"] in ("worker_suspected", "step_aborted")]
    assert not blamed, blamed
    late = [e["late_s"] for e in evs if e["event"] == "coordinator_late"]
    assert late and STOP_S - TIMEOUT_S - 0.2 <= max(late) <= STOP_S + 0.5, late
    assert sum(e["event"] == "step_committed" for e in evs) == 60
