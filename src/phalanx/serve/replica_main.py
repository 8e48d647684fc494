"""One replica process: ``python -m phalanx.serve.replica_main --checkpoint RUN_OR_DIR --port P``.

Binds loopback by default; prints ``PHALANX_REPLICA_READY <port>`` once it accepts requests (port 0
picks a free one), so a parent process (router, tests) knows where it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys

import torch
import uvicorn

from phalanx.core.errors import PhalanxError
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
    ap.add_argument("--threads", type=int, default=1)
    return ap


async def serve(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    served = random_model(args.random_weights) if args.random_weights is not None else load_served_model(args.checkpoint, device)
    engine = ReplicaEngine(served, EngineConfig(args.batch_size_max, args.queue_depth_max, args.slowdown_factor))
    app = build_replica_app(engine, args.model_name)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=30, lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    for _ in range(600):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    if server.started:
        print(f"{READY_LINE} {sock.getsockname()[1]} {served.version}", flush=True)
    await task


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        asyncio.run(serve(args))
    except PhalanxError as e:
        print(f"phalanx replica: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
