"""``phalanx serve`` and ``phalanx loadtest``: argument parsing and printing only."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any


def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from phalanx.core.auth import read_token_file
    from phalanx.serve.cluster import make_token_file, router_config, serve_forever, spawn_replicas, stop_replicas
    from phalanx.serve.served_model import find_checkpoint

    if args.demo:
        from phalanx.serve.demo import run_demo

        return run_demo(Path(args.demo), checkpoint=args.checkpoint, duration_s=args.demo_duration)
    ckpt = find_checkpoint(args.checkpoint)  # NoCheckpoint says to run `phalanx train` first
    faults = None
    if args.fault_plan:
        from phalanx.serve.serving_faults import load_serving_faults

        faults = load_serving_faults(args.fault_plan, args.replicas)  # refused with file:line before anything starts
    token_file = Path(args.token_file) if args.token_file else make_token_file()
    read_token_file(token_file)  # a bad token file is a one-line error, not a replica that never starts
    print(f"phalanx serve: loading {ckpt} into {args.replicas} replicas ...", flush=True)
    reps = spawn_replicas(args.replicas, ["--checkpoint", str(ckpt), "--batch-size-max", str(args.batch_size_max),
                                          "--queue-depth-max", str(args.queue_depth_max)], token_file)
    try:
        serve_forever(reps, router_config(args.policy, args.hedging, args.active_requests_max), args.port, token_file,
                      api_key=args.api_key or None, faults=faults)
    finally:
        stop_replicas(reps)
    return 0


def _loadtest(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from phalanx.serve.loadtest import LoadSpec, dump, run_load, summarize

    spec = LoadSpec(url=args.url.rstrip("/").removesuffix("/v1"), duration_s=args.duration, rate_per_s=args.rate,
                    concurrency=args.concurrency if args.rate is None else None, stream=args.stream,
                    max_tokens=args.max_tokens)
    with Progress() as progress:
        task = progress.add_task("load", total=spec.duration_s)

        def tick(res: Any, elapsed_s: float) -> None:
            progress.update(task, completed=min(elapsed_s, spec.duration_s),
                            description=f"ok {res.ok} err {res.errors} 429 {res.rejected_429}")

        res = asyncio.run(run_load(spec, tick))
    summary = summarize(spec, res)
    print(json.dumps({k: summary[k] for k in ("requests", "ok", "errors", "rejected_429", "throughput_per_s",
                                              "latency_s", "ttft_s")}, indent=2))
    if args.out:
        dump(args.out, summary)
    return 0 if res.errors == 0 else 1


def register(sub: Any) -> None:
    s = sub.add_parser("serve", help="serve the trained model: N replicas behind a fault-tolerant router (loopback)")
    s.add_argument("--replicas", type=int, default=4)
    s.add_argument("--checkpoint", default=None, help="run directory or checkpoint (default: latest runs/train-*)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--policy", default="p2c-latency", choices=["p2c-latency", "p2c-queue", "round-robin"])
    s.add_argument("--hedging", action="store_true", help="send a second copy after the rolling p95 (10 %% budget)")
    s.add_argument("--fault-plan", default=None, help="serving fault plan (TOML): kill, freeze, hang, straggler, "
                   "latency, loss, partition of replica 'worker = i' at 'at_s'")
    s.add_argument("--api-key", default=os.environ.get("PHALANX_API_KEY"),
                   help="clients must send 'Authorization: Bearer KEY' (default: $PHALANX_API_KEY; unset: open)")
    s.add_argument("--token-file", default=None, help="cluster token for router<->replica traffic "
                   "(default: a fresh one, mode 600, in a private temp dir)")
    s.add_argument("--active-requests-max", type=int, default=256, help="past this, 429 with Retry-After")
    s.add_argument("--demo", default=None, metavar="RUN_DIR", help="run the serving demo (4 replicas, a load "
                   "test through a fault plan, a latency table per policy, report.html in RUN_DIR) and exit")
    s.add_argument("--demo-duration", type=float, default=20.0, help="seconds of load in the demo")
    s.add_argument("--batch-size-max", type=int, default=32)
    s.add_argument("--queue-depth-max", type=int, default=64)
    s.set_defaults(fn=_serve)
    lt = sub.add_parser("loadtest", help="load an OpenAI-compatible endpoint; latency and TTFT percentiles")
    lt.add_argument("url")
    g = lt.add_mutually_exclusive_group()
    g.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    g.add_argument("--concurrency", type=int, default=4, help="closed loop: this many clients")
    lt.add_argument("--duration", type=float, default=10.0)
    lt.add_argument("--stream", action="store_true")
    lt.add_argument("--max-tokens", type=int, default=16)
    lt.add_argument("--out", default=None, help="write JSON results here")
    lt.set_defaults(fn=_loadtest)
