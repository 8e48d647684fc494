"""The router as its own process: ``python -m phalanx.serve.router_main --replica r0=http://127.0.0.1:P ...``.

Prints ``PHALANX_ROUTER_READY <port>`` once it accepts requests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import uvicorn

from phalanx.core.auth import read_token_file
from phalanx.core.errors import ConfigError, PhalanxError
from phalanx.serve.asgi_server import EVENT_LOOPS, http_impl, run
from phalanx.serve.cluster import ROUTER_READY_LINE, bind_loopback, router_config
from phalanx.serve.replica_main import _exit_with_parent
from phalanx.serve.router import Router
from phalanx.serve.rollout import follow_run
from phalanx.serve.router_app import build_router_app
from phalanx.serve.routing_policy import POLICY_NAMES, policy_help

READY_LINE = ROUTER_READY_LINE


async def _serve(args: argparse.Namespace) -> None:
    urls = dict(spec.split("=", 1) for spec in args.replica)
    if not args.token_file:
        raise ConfigError("the router needs the cluster token its replicas accept: --token-file F or PHALANX_TOKEN_FILE")
    cfg = router_config(args.policy, args.hedging, args.active_requests_max, args.consistency, args.outlier_ratio,
                        not args.no_ejection_moves)
    router = Router(urls, cfg, seed=args.seed, token=read_token_file(args.token_file))
    sock = bind_loopback(args.port, args.host)
    server = uvicorn.Server(uvicorn.Config(build_router_app(router, args.api_key or None), log_level="warning",
                                           lifespan="on", http=http_impl(args.event_loop),
                                           proxy_headers=False))  # no proxy in front: skip X-Forwarded-* per request
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
    if args.exit_with_parent:
        asyncio.create_task(_exit_with_parent(server, os.getppid()))
    follower = None
    if args.follow:
        follower = asyncio.create_task(follow_run(router, Path(args.follow), args.follow_poll_s,
                                                  log=lambda m: print(m, flush=True)))
    try:
        await task
    finally:
        if follower is not None:
            follower.cancel()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--replica", action="append", default=[], help="ID=URL, repeatable")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--host", default="127.0.0.1", help="listen address (loopback unless told otherwise)")
    ap.add_argument("--consistency", default="consistent", choices=["consistent", "available"],
                    help="during a rollout: a session never sees an older version (consistent) or any healthy replica")
    ap.add_argument("--follow", default=None, metavar="RUN_DIR", help="roll out each new checkpoint of this run")
    ap.add_argument("--follow-poll-s", type=float, default=2.0)
    ap.add_argument("--policy", default="p2c-latency", choices=list(POLICY_NAMES),
                    help=policy_help(" (default p2c-latency)"))
    ap.add_argument("--hedging", action="store_true", help="add hedging to --policy (p2c-latency --hedging is "
                    "p2c-latency+hedge)")
    ap.add_argument("--outlier-ratio", type=float, default=None,
                    help="passive ejection of a replica whose latency EWMA is this many times the others' median "
                         "(default 5; 0 turns it off)")
    ap.add_argument("--no-ejection-moves", action="store_true",
                    help="an ejected replica keeps the requests already waiting on it (default: those expected to "
                         "finish sooner elsewhere move, each at most once)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--token-file", default=os.environ.get("PHALANX_TOKEN_FILE"))
    ap.add_argument("--api-key", default=os.environ.get("PHALANX_API_KEY"),
                    help="clients must send this bearer key (default: $PHALANX_API_KEY; none: open)")
    ap.add_argument("--exit-with-parent", action="store_true", help="exit when the process that started it dies")
    ap.add_argument("--active-requests-max", type=int, default=256, help="past this, 429 with Retry-After")
    ap.add_argument("--event-loop", default="auto", choices=EVENT_LOOPS,
                    help="auto: uvloop + httptools when installed; asyncio: plain asyncio + h11")
    args = ap.parse_args(argv)
    try:
        run(_serve(args), args.event_loop, "phalanx router")
    except PhalanxError as e:
        print(f"phalanx router: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
