"""Real replica processes on loopback for the serving tests (untrained weights: no training run needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from phalanx.core.auth import read_token_file
from phalanx.serve.cluster import make_token_file
from phalanx.serve.replica_main import READY_LINE
from phalanx.serve.request_auth import ClusterTokenAuth


@dataclass
class ReplicaProc:
    proc: subprocess.Popen[str]
    port: int
    token: bytes

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kw) -> httpx.Client:
        """An httpx client that signs its requests with the cluster token (as the router does)."""
        return httpx.Client(auth=ClusterTokenAuth(self.token), **kw)


def start_replica(token_file: Path, *extra: str, ready_timeout_s: float = 60.0) -> ReplicaProc:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PHALANX_TOKEN_FILE=str(token_file))
    proc = subprocess.Popen([sys.executable, "-m", "phalanx.serve.replica_main", "--random-weights", "0",
                             "--port", "0", *extra], stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + ready_timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(READY_LINE):
            return ReplicaProc(proc, int(line.split()[1]), read_token_file(token_file))
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("replica did not become ready")


def stop(r: ReplicaProc) -> None:
    if r.proc.poll() is None:
        r.proc.kill()
    r.proc.wait(10)
    if r.proc.stdout is not None:
        r.proc.stdout.close()


@pytest.fixture(scope="session")
def token_file(tmp_path_factory) -> Path:
    return make_token_file(tmp_path_factory.mktemp("token"))


@pytest.fixture(scope="module")
def replica(token_file) -> Iterator[ReplicaProc]:
    r = start_replica(token_file, "--batch-size-max", "8", "--queue-depth-max", "4")
    yield r
    stop(r)
