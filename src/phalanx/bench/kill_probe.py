"""The OS's part of a kill's detection, measured on this machine: how long after SIGKILL a peer
sees the socket of a worker-like process close (bench/fidelity.py calibrates the simulator's
``process_exit_s`` with it; no fault-free run shows it)."""

from __future__ import annotations

import statistics
from typing import Any

_PROBE = ("import os, socket, sys, threading, time\n"
          "import numpy as np\n"
          "import torch\n"
          "from phalanx.workload.charlm_train import build\n"
          "from phalanx.workload.model import build_model, build_optimizer, loss_fn\n"
          "torch.set_num_threads(1)  # as charlm_train does\n"
          "cfg, data = build()\n"
          "model, opt = build_model(cfg), None\n"
          "opt = build_optimizer(model, cfg)\n"
          "pace = float(sys.argv[2])\n"
          "import datetime, torch.distributed as dist\n"
          "rank, world = int(sys.argv[4]), int(sys.argv[5])\n"
          "store = dist.TCPStore('127.0.0.1', int(sys.argv[3]), world, False)\n"
          "pg = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=60))  # a worker's Gloo threads\n"
          "def train():\n"
          "    while True:\n"
          "        # paced, as the workers are, and in step: every probe starts a step on the same grid of\n"
          "        # the machine-wide monotonic clock, as a job's workers start one on the same commit\n"
          "        time.sleep(pace - time.monotonic() % pace)\n"
          "        x, y = data.batch(np.arange(8)); loss_fn(model(x), y).backward()\n"
          "        try:  # the gradient's all-reduce, as a worker's step has\n"
          "            pg.allreduce([torch.cat([p.grad.reshape(-1) for p in model.parameters()])]).wait()\n"
          "        except Exception:\n"
          "            time.sleep(60)  # a peer was killed: this round is over\n"
          "        opt.step(); opt.zero_grad()\n"
          "threading.Thread(target=train, daemon=True).start()\n"
          "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
          "s.sendall(b'%10d' % os.getpid())\n"
          "time.sleep(60)\n")


KILL_INTO_STEP_S = 0.002  # where a planned kill lands in a step: its at_step trigger polls every 5 ms after a commit


def probe_process_exit_s(min_step_s: float, workers: int = 4, rounds: int = 9) -> float:
    """How long after SIGKILL a peer sees the socket of a worker-like process close: the OS part of
    kill detection, which no fault-free run shows. Each round starts ``workers`` processes that
    train the bundled model, each step paced to ``min_step_s`` and all in step (a job's load on this
    machine, not an idle one), and SIGKILLs one of them ``KILL_INTO_STEP_S`` into a step, as a plan's
    ``at_step`` kill lands: just after a commit, when the victim and every survivor start computing
    at once, so the teardown competes with the survivors' compute for the cores (session 17: 34 ms
    on a quiet 2-core box, against 22 ms for a kill at a random point of the step). The processes
    all-reduce their gradients in a Gloo group, as workers do (a Gloo group's threads and sockets
    are part of what the OS tears down: +5 ms in session 17's experiment). One kill a round,
    so every kill has ``workers - 1`` survivors, as in the fault run. Median over the rounds (9: with
    5, two fidelity runs seven minutes apart read 10.7 and 26.2 ms; with 9, 24.0 and 25.7; session 35)."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    from torch.distributed import TCPStore

    from phalanx.train.host_memory import worker_hugepage_env

    env = {**os.environ, **worker_hugepage_env(os.environ)[0]}  # pages as the launcher gives its workers
    times = []
    for r in range(rounds):
        with socket.socket() as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen(workers)
            store = TCPStore("127.0.0.1", 0, workers + 1, True, wait_for_workers=False)
            procs = [subprocess.Popen([sys.executable, "-c", _PROBE, str(srv.getsockname()[1]), str(min_step_s),
                                       str(store.port), str(rank), str(workers)], env=env) for rank in range(workers)]
            conns = [srv.accept()[0] for _ in procs]
            try:
                # accept order is not start order: each probe sends its pid first
                by_pid = {int(_recv_exactly(c, 10)): c for c in conns}
                time.sleep(0.5)  # let them train for a moment, as workers would be
                victim = procs[r % workers]
                time.sleep(min_step_s - time.monotonic() % min_step_s + KILL_INTO_STEP_S)
                t0 = time.monotonic()
                os.kill(victim.pid, signal.SIGKILL)
                by_pid[victim.pid].recv(1)  # b"" at EOF / reset
                times.append(time.monotonic() - t0)
            finally:
                for proc in procs:
                    proc.kill()
                    proc.wait()
                for c in conns:
                    c.close()
    return statistics.median(times)


def _recv_exactly(conn: Any, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise RuntimeError("a probe process exited before it said who it is")
        buf += chunk
    return buf
