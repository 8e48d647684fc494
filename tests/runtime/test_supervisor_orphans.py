"""A SIGKILLed launcher leaves no worker behind: workers get a parent-death signal."""

import os
import signal
import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from phalanx.runtime.supervisor import Supervisor
    run = Path(sys.argv[1])
    (run / "workers").mkdir(parents=True, exist_ok=True)
    sup = Supervisor([sys.executable, "-c", "import time; time.sleep(120)"], {}, run, 2, False)
    sup.start_all()
    print(" ".join(str(w.proc.pid) for w in sup.workers), flush=True)
    time.sleep(120)
""")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, only not yet reaped
        return f.read().split(")")[-1].split()[0] != "Z"


def test_workers_die_when_the_launcher_is_sigkilled(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in launcher.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), "orphaned workers outlived their launcher"
    finally:
        launcher.kill()
