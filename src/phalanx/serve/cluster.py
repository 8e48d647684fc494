"""Start N replica processes and the router in front of them on loopback (``phalanx serve``)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import uvicorn

from phalanx.serve.errors import ServeError
from phalanx.serve.replica_main import READY_LINE
from phalanx.serve.router import Router, RouterConfig
from phalanx.serve.router_app import build_router_app


class ReplicaStartFailed(ServeError):
    pass


@dataclass
class ReplicaProcess:
    replica_id: str
    proc: subprocess.Popen[str]
    port: int
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def spawn_replica(replica_id: str, args: list[str], ready_timeout_s: float = 120.0) -> ReplicaProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "phalanx.serve.replica_main", "--port", "0", *args],
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:  # bounded by the deadline and by EOF when the child exits
        line = proc.stdout.readline()
        if line.startswith(READY_LINE):
            return ReplicaProcess(replica_id, proc, int(line.split()[1]), args)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    proc.wait(10)
    raise ReplicaStartFailed(f"replica {replica_id} did not start (exit code {proc.poll()}); see its output above")


def spawn_replicas(n: int, args: list[str], per_replica: dict[int, list[str]] | None = None) -> list[ReplicaProcess]:
    out: list[ReplicaProcess] = []
    try:
        for i in range(n):
            out.append(spawn_replica(f"r{i}", args + (per_replica or {}).get(i, [])))
    except BaseException:
        stop_replicas(out)
        raise
    return out


def stop_replicas(replicas: list[ReplicaProcess]) -> None:
    for r in replicas:
        if r.proc.poll() is None:
            with_suppress_kill(r.proc, signal.SIGCONT)
            r.proc.kill()
    for r in replicas:
        r.proc.wait(10)


def with_suppress_kill(proc: subprocess.Popen[str], sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def bind_loopback(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


async def run_router(router: Router, sock: socket.socket, on_ready: object = None) -> None:
    server = uvicorn.Server(uvicorn.Config(build_router_app(router), log_level="warning", lifespan="on",
                                           timeout_keep_alive=30, timeout_graceful_shutdown=5))
    await server.serve(sockets=[sock])


def router_config(policy: str, hedging: bool) -> RouterConfig:
    from phalanx.serve.routing_policy import Policy, PolicyConfig

    return RouterConfig(policy=PolicyConfig(policy=Policy(policy)), hedging=hedging)


def serve_forever(replicas: list[ReplicaProcess], cfg: RouterConfig, port: int) -> None:
    router = Router({r.replica_id: r.url for r in replicas}, cfg)
    sock = bind_loopback(port)
    print(f"phalanx serve: {len(replicas)} replicas, router on http://127.0.0.1:{sock.getsockname()[1]}/v1 "
          f"(policy {cfg.policy.policy.value})", flush=True)
    asyncio.run(run_router(router, sock))
