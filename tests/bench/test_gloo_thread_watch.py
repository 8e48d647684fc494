"""The fidelity benchmark's Gloo thread watch: it finds the workload's worker processes by module
and worker id, and counts the CPU of their threads named like Gloo's (not the others')."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.bench.gloo_thread_watch import GlooThreadWatch

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads Linux /proc")

_WORKLOAD = """
import ctypes, threading, time
def spin(name, until):
    ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: the thread's comm
    while time.monotonic() < until:
        pass
until = time.monotonic() + 2.0
threads = [threading.Thread(target=spin, args=(n, until)) for n in ("gloo_tcp_loop", "pt_data_loader")]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


def test_watch_counts_the_gloo_named_threads_of_each_worker_process(tmp_path):
    (tmp_path / "fake_worker_mod.py").write_text(_WORKLOAD)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PHALANX_WORKER_ID": "w7"}
    with GlooThreadWatch(module="fake_worker_mod", interval_s=0.2) as watch:
        proc = subprocess.Popen([sys.executable, "-m", "fake_worker_mod"], env=env)
        try:
            proc.wait(timeout=60)
        finally:
            proc.kill()
        time.sleep(0.5)  # one more sample after the end changes nothing: the process is gone
    rows = [r for r in watch.summary() if r["pid"] == proc.pid]
    assert len(rows) == 1 and rows[0]["worker"] == "w7"
    # the gloo-named thread spun for ~2 s (a share of it on a loaded box); the other is not counted:
    # at most the gloo thread's own wall time, never both threads' CPU
    assert 0.05 < rows[0]["gloo_cpu_s"] <= 2.5
    assert rows[0]["busiest_gloo_thread_peak_core"] > 0.1


def test_watch_ignores_processes_of_other_modules(tmp_path):
    (tmp_path / "fake_worker_mod.py").write_text(_WORKLOAD)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PHALANX_WORKER_ID": "w7"}
    with GlooThreadWatch(module="some_other_module", interval_s=0.2) as watch:
        subprocess.run([sys.executable, "-m", "fake_worker_mod"], env=env, timeout=60, check=True)
    assert watch.summary() == []
