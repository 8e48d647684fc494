"""Real replica processes on loopback for the serving tests (untrained weights: no training run needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from phalanx.serve.replica_main import READY_LINE


@dataclass
class ReplicaProc:
    proc: subprocess.Popen[str]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_replica(*extra: str, ready_timeout_s: float = 60.0) -> ReplicaProc:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "phalanx.serve.replica_main", "--random-weights", "0",
                             "--port", "0", *extra], stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + ready_timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(READY_LINE):
            return ReplicaProc(proc, int(line.split()[1]))
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("replica did not become ready")


def stop(r: ReplicaProc) -> None:
    if r.proc.poll() is None:
        r.proc.kill()
    r.proc.wait(10)


@pytest.fixture(scope="module")
def replica() -> Iterator[ReplicaProc]:
    r = start_replica("--batch-size-max", "8", "--queue-depth-max", "4")
    yield r
    stop(r)
