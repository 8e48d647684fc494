"""One replica process: ``python -m phalanx.serve.replica_main --checkpoint RUN_OR_DIR --port P``.

Binds loopback by default; prints ``PHALANX_REPLICA_READY <port>`` once it accepts requests (port 0
picks a free one), so a parent process (router, tests) knows where it listens. Every request must be
signed with the cluster token (``--token-file`` or ``PHALANX_TOKEN_FILE``). SIGTERM drains: no new
requests (503 ``draining``, /health says so and the router stops routing here), the running and
waiting generations finish, then the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time
from types import FrameType

import torch
import uvicorn

from phalanx.core.auth import read_token_file
from phalanx.core.errors import ConfigError, PhalanxError
from phalanx.serve.admin_client import default_replica_id, join_router
from phalanx.serve.asgi_server import EVENT_LOOPS, http_impl, run
from phalanx.serve.engine import EngineConfig, ReplicaEngine
from phalanx.serve.replica_app import build_replica_app
from phalanx.serve.served_model import load_served_model, random_model

READY_LINE = "PHALANX_REPLICA_READY"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--checkpoint", default=None, help="run directory or checkpoint folder (default: latest runs/train-*)")
    ap.add_argument("--random-weights", type=int, default=None, metavar="SEED",
                    help="serve an untrained model (tests, benchmarks)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model-name", default="phalanx-charlm")
    ap.add_argument("--batch-size-max", type=int, default=32)
    ap.add_argument("--queue-depth-max", type=int, default=64)
    ap.add_argument("--slowdown-factor", type=float, default=1.0, help="straggler fault: every step N times slower")
    ap.add_argument("--min-step-s", type=float, default=0.0, help="benchmarks: each decode step takes at least this long")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--token-file", default=os.environ.get("PHALANX_TOKEN_FILE"),
                    help="cluster token the router signs requests with (default: $PHALANX_TOKEN_FILE)")
    ap.add_argument("--drain-timeout-s", type=float, default=30.0)
    ap.add_argument("--log-level", default="warning", help="uvicorn's log level")
    ap.add_argument("--event-loop", default="auto", choices=EVENT_LOOPS,
                    help="auto: uvloop + httptools when installed; asyncio: plain asyncio + h11")
    ap.add_argument("--exit-with-parent", action="store_true", help="exit when the process that started it dies")
    ap.add_argument("--join", default=None, metavar="HOST:PORT", help="register with this running router (its "
                    "admin route, signed with the cluster token); it routes here once this replica answers healthy")
    ap.add_argument("--replica-id", default=None, help="name at the router (default: HOSTNAME-PORT)")
    ap.add_argument("--advertise-host", default=None, help="address the router reaches this replica at "
                    "(default: --host, or this machine's name when --host is 0.0.0.0)")
    return ap


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM drains instead of closing the listener at once."""

    def __init__(self, config: uvicorn.Config, engine: ReplicaEngine, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.engine, self.drain_timeout_s = engine, drain_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.engine.draining and self.loop is not None:
            self.engine.draining = True  # from here every new completion is a 503 the router retries elsewhere
            self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain()))  # type: ignore[union-attr]
            return
        super().handle_exit(sig, frame)

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while not self.engine.is_idle and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # the last chunks and [DONE] leave before the listener closes
        print(f"PHALANX_REPLICA_DRAINED idle={self.engine.is_idle}", flush=True)
        self.should_exit = True


async def serve(args: argparse.Namespace) -> None:
    if not args.token_file:
        raise ConfigError("a replica needs the cluster token: pass --token-file F or set PHALANX_TOKEN_FILE "
                          "(`phalanx token --out F` makes one; `phalanx serve` makes one per run)")
    token = read_token_file(args.token_file)
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    served = random_model(args.random_weights) if args.random_weights is not None else load_served_model(args.checkpoint, device)
    engine = ReplicaEngine(served, EngineConfig(args.batch_size_max, args.queue_depth_max, args.slowdown_factor,
                                                       args.min_step_s))
    app = build_replica_app(engine, args.model_name, token)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # else 40 ms per answer (cluster.bind_loopback)
    sock.bind((args.host, args.port))
    server = DrainingServer(uvicorn.Config(app, log_level=args.log_level, timeout_keep_alive=30, lifespan="on",
                                           http=http_impl(args.event_loop),
                                           timeout_graceful_shutdown=int(args.drain_timeout_s)),
                            engine, args.drain_timeout_s)
    server.loop = asyncio.get_running_loop()
    task = asyncio.create_task(server.serve(sockets=[sock]))
    for _ in range(600):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    if server.started:
        print(f"{READY_LINE} {sock.getsockname()[1]} {served.version}", flush=True)
    if args.exit_with_parent:
        asyncio.create_task(_exit_with_parent(server, os.getppid()))
    if args.join and server.started:
        port = sock.getsockname()[1]
        host = args.advertise_host or (socket.gethostname() if args.host in ("0.0.0.0", "::") else args.host)
        rid = args.replica_id or default_replica_id(port)
        try:
            joined = await join_router(args.join, token, rid, f"http://{host}:{port}")
        except PhalanxError:
            server.should_exit = True
            await task
            raise
        print(f"PHALANX_REPLICA_JOINED {rid} {joined.get('members')}", flush=True)
    await task


async def _exit_with_parent(server: uvicorn.Server, parent_pid: int) -> None:
    """A replica started by `phalanx serve`, a benchmark or a test does not outlive it (no leaked process)."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(0.5)
    server.should_exit = True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(serve(args), args.event_loop, "phalanx replica")
    except PhalanxError as e:
        print(f"phalanx replica: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
