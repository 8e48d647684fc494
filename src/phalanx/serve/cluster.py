"""Start N replica processes and the router in front of them on loopback (``phalanx serve``, the
benchmarks, the demo and the integration tests all start them through here).

Every serving run has a cluster token (a fresh one in a mode-600 file unless one is given): the
replicas refuse any request the router has not signed with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from phalanx.core.auth import generate_token, read_token_file, write_token_file
from phalanx.core.errors import ConfigError
from phalanx.serve.asgi_server import http_impl
from phalanx.serve.asgi_server import run as run_serving
from phalanx.serve.errors import ServeError
from phalanx.serve.replica_main import READY_LINE
from phalanx.serve.router import Router, RouterConfig
from phalanx.serve.router_app import build_router_app

ROUTER_READY_LINE = "PHALANX_ROUTER_READY"  # printed by router_main


class ReplicaStartFailed(ServeError):
    pass


@dataclass
class ReplicaProcess:
    replica_id: str
    proc: subprocess.Popen[str]
    port: int
    args: list[str] = field(default_factory=list)
    token_file: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restart(self, ready_timeout_s: float = 120.0) -> None:
        """A fresh process on the same port (after a kill): the router re-admits it once it proves healthy."""
        assert self.token_file is not None and self.proc.poll() is not None
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = spawn_replica(self.replica_id, self.args, self.token_file, ready_timeout_s, self.port).proc


def make_token_file(directory: str | Path | None = None) -> Path:
    """A fresh cluster token in ``directory`` (a new private temp dir by default), mode 600."""
    d = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="phalanx-serve-"))
    d.mkdir(parents=True, exist_ok=True)
    path = d / "serve.token"
    write_token_file(path, generate_token())
    return path


def _env(token_file: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PHALANX_TOKEN_FILE=str(token_file))


def _start_replica(args: list[str], token_file: Path, port: int = 0) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "phalanx.serve.replica_main", "--port", str(port),
                             "--exit-with-parent", *args], stdout=subprocess.PIPE, text=True, env=_env(token_file))


def _wait_ready(replica_id: str, proc: subprocess.Popen[str], args: list[str], deadline_s: float,
                token_file: Path | None = None) -> ReplicaProcess:
    assert proc.stdout is not None
    while time.monotonic() < deadline_s:  # bounded by the deadline and by EOF when the child exits
        line = proc.stdout.readline()
        if line.startswith(READY_LINE):
            return ReplicaProcess(replica_id, proc, int(line.split()[1]), args, token_file)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    proc.wait(10)
    raise ReplicaStartFailed(f"replica {replica_id} did not start (exit code {proc.poll()}); see its output above")


def spawn_replica(replica_id: str, args: list[str], token_file: Path, ready_timeout_s: float = 120.0,
                  port: int = 0) -> ReplicaProcess:
    return _wait_ready(replica_id, _start_replica(args, token_file, port), args, time.monotonic() + ready_timeout_s,
                       token_file)


def spawn_replicas(n: int, args: list[str], token_file: Path, per_replica: dict[int, list[str]] | None = None,
                   ready_timeout_s: float = 120.0) -> list[ReplicaProcess]:
    """Start all N at once (they load the model in parallel), then wait for each to be ready."""
    full = [args + (per_replica or {}).get(i, []) for i in range(n)]
    procs = [_start_replica(a, token_file) for a in full]
    out: list[ReplicaProcess] = []
    deadline_s = time.monotonic() + ready_timeout_s
    try:
        for i, (proc, a) in enumerate(zip(procs, full)):
            out.append(_wait_ready(f"r{i}", proc, a, deadline_s, token_file))
    except BaseException:
        for proc in procs[len(out):]:
            proc.kill()
            proc.wait(10)
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
        if r.proc.stdout is not None:
            r.proc.stdout.close()


def with_suppress_kill(proc: subprocess.Popen[str], sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


@dataclass
class RouterProcess:
    proc: subprocess.Popen[str]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def spawn_router(replicas: dict[str, str], token_file: Path, policy: str = "p2c-latency", hedging: bool = False,
                 extra: list[str] | None = None, ready_timeout_s: float = 60.0) -> RouterProcess:
    cmd = [sys.executable, "-m", "phalanx.serve.router_main", "--port", "0", "--exit-with-parent", "--policy", policy,
           *[f"--replica={k}={v}" for k, v in sorted(replicas.items())], *(["--hedging"] if hedging else []),
           *(extra or [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=_env(token_file))
    assert proc.stdout is not None
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(ROUTER_READY_LINE):
            return RouterProcess(proc, int(line.split()[1]))
        if not line and proc.poll() is not None:
            break
    proc.kill()
    proc.wait(10)
    raise ReplicaStartFailed(f"the router did not start (exit code {proc.poll()})")


def bind_loopback(port: int, host: str = "127.0.0.1") -> socket.socket:
    """Loopback unless ``host`` says otherwise (a router other machines' replicas join).

    TCP_NODELAY on the listener, inherited by every accepted connection: asyncio only disables Nagle
    on sockets created with ``proto=IPPROTO_TCP``, which a socket we bind ourselves is not (proto 0),
    so uvicorn's separate writes of headers and body waited for the client's delayed ACK: 40 ms added
    to every answer (measured: /health 44 ms -> 0.4 ms)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # see tcp_listener
    sock.bind((host, port))
    return sock


def router_config(policy: str, hedging: bool, active_requests_max: int = 256,
                  consistency: str = "consistent", outlier_ratio: float | None = None,
                  ejection_moves: bool = True) -> RouterConfig:
    from phalanx.serve.routing_policy import PolicyConfig, parse_policy
    from phalanx.serve.versions import Consistency

    try:
        choice, hedge = parse_policy(policy)  # "p2c-latency+hedge" is p2c-latency with hedging
    except ValueError as e:
        raise ConfigError(str(e)) from None
    hedging = hedging or hedge
    pc = PolicyConfig(policy=choice)
    if outlier_ratio is not None:
        if not outlier_ratio >= 0:  # NaN too
            raise ConfigError(f"--outlier-ratio must be >= 0 (0 turns passive ejection off), got {outlier_ratio}")
        pc = dataclasses.replace(pc, outlier_latency_ratio=outlier_ratio)
    pc = dataclasses.replace(pc, ejection_moves=ejection_moves)
    return RouterConfig(policy=pc, hedging=hedging,
                        active_requests_max=active_requests_max, consistency=Consistency(consistency))


def serve_forever(replicas: list[ReplicaProcess], cfg: RouterConfig, port: int, token_file: Path,
                  api_key: str | None = None, faults: list | None = None,  # type: ignore[type-arg]
                  follow: Path | None = None, host: str = "127.0.0.1") -> None:
    router = Router({r.replica_id: r.url for r in replicas}, cfg, token=read_token_file(token_file))
    sock = bind_loopback(port, host)
    url = f"http://{host}:{sock.getsockname()[1]}"
    print(f"phalanx serve: {len(replicas)} replicas, router on {url}/v1 "
          f"(policy {cfg.policy.policy.value}, {cfg.consistency.value}{', API key required' if api_key else ''})\n"
          f"  roll out new weights: phalanx serve rollout --router {url} --token-file {token_file} --checkpoint NEW\n"
          f"  add a replica:        phalanx serve replica --join {host}:{sock.getsockname()[1]} --token-file F",
          flush=True)

    async def main() -> None:
        server = uvicorn.Server(uvicorn.Config(build_router_app(router, api_key), log_level="warning", lifespan="on",
                                               timeout_keep_alive=30, timeout_graceful_shutdown=5,
                                               http=http_impl("auto"), proxy_headers=False))
        driver = follower = None
        if follow is not None:
            from phalanx.serve.rollout import follow_run

            follower = asyncio.create_task(follow_run(router, follow, log=lambda m: print(m, flush=True)))
        if faults:
            from phalanx.serve.fault_driver import run_fault_plan

            driver = asyncio.create_task(run_fault_plan(faults, replicas, read_token_file(token_file),
                                                        log=lambda m: print(f"fault: {m}", flush=True)))
        try:
            await server.serve(sockets=[sock])
        finally:
            for t in (driver, follower):
                if t is not None:
                    t.cancel()

    run_serving(main(), "auto", "phalanx serve")
