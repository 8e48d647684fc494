"""The router as its own process: ``python -m phalanx.serve.router_main --replica r0=http://127.0.0.1:P ...``.

Prints ``PHALANX_ROUTER_READY <port>`` once it accepts requests.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import uvicorn

from phalanx.serve.cluster import bind_loopback, router_config
from phalanx.serve.router import Router
from phalanx.serve.router_app import build_router_app

READY_LINE = "PHALANX_ROUTER_READY"


async def _serve(args: argparse.Namespace) -> None:
    urls = dict(spec.split("=", 1) for spec in args.replica)
    router = Router(urls, router_config(args.policy, args.hedging), seed=args.seed)
    sock = bind_loopback(args.port)
    server = uvicorn.Server(uvicorn.Config(build_router_app(router), log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    for _ in range(1000):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    # ready once membership has admitted every replica (or 5 s passed)
    for _ in range(50):
        if all(r.stats.healthy for r in router.replicas.values()):
            break
        await asyncio.sleep(0.1)
    print(f"{READY_LINE} {sock.getsockname()[1]}", flush=True)
    await task


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--replica", action="append", default=[], help="ID=URL, repeatable")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--policy", default="p2c-latency", choices=["p2c-latency", "p2c-queue", "round-robin"])
    ap.add_argument("--hedging", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
