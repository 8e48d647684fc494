"""``phalanx serve`` and ``phalanx loadtest``: argument parsing and printing only."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any


def _serve(args: argparse.Namespace) -> int:
    import signal
    import sys
    from pathlib import Path

    from phalanx.serve.cluster import make_token_file
    from phalanx.serve.served_model import find_checkpoint

    # SIGTERM ends the run like Ctrl-C: replicas stopped, the fresh token's temp folder removed
    # (the default action would kill this process with both left behind)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    if args.demo:
        from phalanx.serve.demo import run_demo

        return run_demo(Path(args.demo), checkpoint=args.checkpoint, duration_s=args.demo_duration)
    ckpt = find_checkpoint(args.checkpoint or args.follow)  # NoCheckpoint says to run `phalanx train` first
    faults = None
    if args.fault_plan:
        from phalanx.serve.serving_faults import load_serving_faults

        faults = load_serving_faults(args.fault_plan, args.replicas)  # refused with file:line before anything starts
    if not args.token_file:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="phalanx-serve-") as tmp:  # the fresh token dies with the run
            return _serve_with(args, ckpt, faults, make_token_file(tmp))
    return _serve_with(args, ckpt, faults, Path(args.token_file))


def _serve_with(args: argparse.Namespace, ckpt: Any, faults: Any, token_file: Any) -> int:
    from pathlib import Path

    from phalanx.core.auth import read_token_file
    from phalanx.serve.cluster import router_config, serve_forever, spawn_replicas, stop_replicas

    read_token_file(token_file)  # a bad token file is a one-line error, not a replica that never starts
    print(f"phalanx serve: loading {ckpt} into {args.replicas} replicas ...", flush=True)
    reps = spawn_replicas(args.replicas, ["--checkpoint", str(ckpt), "--batch-size-max", str(args.batch_size_max),
                                          "--queue-depth-max", str(args.queue_depth_max)], token_file)
    try:
        serve_forever(reps, router_config(args.policy, args.hedging, args.active_requests_max, args.consistency),
                      args.port, token_file, api_key=args.api_key or None, faults=faults,
                      follow=Path(args.follow) if args.follow else None, host=args.host)
    finally:
        stop_replicas(reps)
    return 0


def _loadtest(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from phalanx.serve.loadtest import LoadSpec, dump, run_load, summarize

    spec = LoadSpec(url=args.url.rstrip("/").removesuffix("/v1"), duration_s=args.duration, rate_per_s=args.rate,
                    concurrency=args.concurrency if args.rate is None else None, stream=args.stream,
                    max_tokens=args.max_tokens, api_key=args.api_key or None)
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
    from phalanx.serve.routing_policy import POLICY_NAMES, policy_help

    s = sub.add_parser("serve", help="serve the trained model: N replicas behind a fault-tolerant router (loopback)")
    s.add_argument("--replicas", type=int, default=4)
    s.add_argument("--checkpoint", default=None, help="run directory or checkpoint (default: latest runs/train-*)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--policy", default="p2c-latency", choices=list(POLICY_NAMES),
                   help=policy_help(" (default p2c-latency)"))
    s.add_argument("--hedging", action="store_true", help="add hedging to --policy: a second copy after the rolling "
                   "p95 (10 %% budget); p2c-latency --hedging is p2c-latency+hedge")
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
    s.add_argument("--follow", default=None, metavar="RUN_DIR", help="roll out each new committed checkpoint of this "
                   "(still training) run, one replica at a time")
    s.add_argument("--consistency", default="consistent", choices=["consistent", "available"],
                   help="during a rollout: a session (user field or X-Session-Id) never sees an older version after "
                   "a newer one (consistent), or any healthy replica serves (available)")
    s.add_argument("--host", default="127.0.0.1", help="the router's listen address (loopback unless told otherwise)")
    s.set_defaults(fn=_serve)
    ssub = s.add_subparsers(dest="serve_action", metavar="{rollout,replica}")
    ro = ssub.add_parser("rollout", help="swap a running `phalanx serve`'s replicas to a checkpoint, one at a time")
    ro.add_argument("--checkpoint", required=True, help="checkpoint folder or run directory (its latest checkpoint)")
    ro.add_argument("--router", default="http://127.0.0.1:8000", help="the router (URL or HOST:PORT)")
    ro.add_argument("--token-file", default=os.environ.get("PHALANX_TOKEN_FILE"),
                    help="the serving run's cluster token (printed by `phalanx serve`; default $PHALANX_TOKEN_FILE)")
    ro.add_argument("--timeout-s", type=float, default=600.0)
    ro.set_defaults(fn=_rollout)
    rj = ssub.add_parser("replica", help="start one replica that joins a running router (another machine)")
    rj.add_argument("--join", required=True, metavar="HOST:PORT", help="the router to register with")
    rj.add_argument("--token-file", default=os.environ.get("PHALANX_TOKEN_FILE"), help="the cluster token")
    rj.add_argument("--checkpoint", default=None, help="run directory or checkpoint (default: latest runs/train-*)")
    rj.add_argument("--random-weights", type=int, default=None, metavar="SEED", help="serve untrained weights")
    rj.add_argument("--host", default="127.0.0.1", help="listen address (loopback unless told otherwise)")
    rj.add_argument("--port", type=int, default=0)
    rj.add_argument("--advertise-host", default=None, help="address the router reaches this replica at")
    rj.add_argument("--replica-id", default=None, help="its name at the router (default HOSTNAME-PORT)")
    rj.add_argument("--batch-size-max", type=int, default=32)
    rj.add_argument("--queue-depth-max", type=int, default=64)
    rj.set_defaults(fn=_replica)
    lt = sub.add_parser("loadtest", help="load an OpenAI-compatible endpoint; latency and TTFT percentiles")
    lt.add_argument("url")
    g = lt.add_mutually_exclusive_group()
    g.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    g.add_argument("--concurrency", type=int, default=4, help="closed loop: this many clients")
    lt.add_argument("--duration", type=float, default=10.0)
    lt.add_argument("--stream", action="store_true")
    lt.add_argument("--max-tokens", type=int, default=16)
    lt.add_argument("--out", default=None, help="write JSON results here")
    lt.add_argument("--api-key", default=os.environ.get("PHALANX_API_KEY"), help="bearer key (default: $PHALANX_API_KEY)")
    lt.set_defaults(fn=_loadtest)


def _rollout(args: argparse.Namespace) -> int:
    from phalanx.core.auth import read_token_file
    from phalanx.core.errors import ConfigError
    from phalanx.serve.admin_client import request_rollout

    if not args.token_file:
        raise ConfigError("rollout is signed with the serving run's cluster token: pass --token-file F "
                          "(`phalanx serve` prints it) or set PHALANX_TOKEN_FILE")
    status, report = request_rollout(args.router, read_token_file(args.token_file), args.checkpoint, args.timeout_s)
    for step in report.get("steps", []):
        print(f"  {step.get('replica')}: " + (f"skipped ({step['skipped']})" if "skipped" in step else
                                              f"{step['version']} in {step['took_s']} s" if step.get("ok") else
                                              f"FAILED: {step.get('error')}"))
    if status == 200 and report.get("ok"):
        print(f"phalanx serve rollout: every replica serves {report['version']} ({report['took_s']} s)")
        return 0
    err = report.get("error")
    print(f"phalanx serve rollout: failed (HTTP {status}): {err.get('message') if isinstance(err, dict) else err}")
    return 1


def _replica(args: argparse.Namespace) -> int:
    from phalanx.serve.replica_main import main as replica_main

    argv = ["--join", args.join, "--host", args.host, "--port", str(args.port), "--batch-size-max",
            str(args.batch_size_max), "--queue-depth-max", str(args.queue_depth_max)]
    if args.token_file:
        argv += ["--token-file", args.token_file]
    for flag, v in (("--checkpoint", args.checkpoint), ("--random-weights", args.random_weights),
                    ("--advertise-host", args.advertise_host), ("--replica-id", args.replica_id)):
        if v is not None:
            argv += [flag, str(v)]
    return replica_main(argv)


def _sim_serve(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from phalanx.serve.routing_policy import POLICY_NAMES, Policy, parse_policy
    from phalanx.serve.serving_faults import load_serving_faults
    from phalanx.serve.sim_serve import SimServeConfig, simulate
    from phalanx.sim.loop import VirtualTimeLoop

    faults = load_serving_faults(args.fault_plan, args.replicas) if args.fault_plan else []
    service_s = args.service_ms / 1000
    rate = args.rate if args.rate else 0.7 * args.replicas * args.slots / service_s
    cases = [("healthy", Policy.P2C_LATENCY, False, [])] + [
        (name, *parse_policy(name), faults) for name in POLICY_NAMES if args.policy in ("all", name)]
    console = Console()
    console.print(f"phalanx sim serve: {args.replicas} replicas x {args.slots} slot(s), {service_s * 1000:g} ms per "
                  f"request, Poisson {rate:.1f} req/s for {args.duration_s:g} virtual s, {len(faults)} fault(s), "
                  f"seed {args.seed}")
    results = {}
    for name, policy, hedging, plan in cases:
        cfg = SimServeConfig(replicas=args.replicas, rate_per_s=rate, duration_s=args.duration_s, service_s=service_s,
                             slots=args.slots, policy=policy, hedging=hedging, seed=args.seed)
        loop = VirtualTimeLoop(args.seed)
        t0 = time.monotonic()
        try:
            results[name] = loop.run_until_complete(simulate(cfg, plan))
        finally:
            loop.close()
        results[name]["wall_s"] = round(time.monotonic() - t0, 2)
    base = results["healthy"]["latency_s"]["p99"] or 1.0
    table = Table(title="policies side by side (virtual time; the router's own decision code)")
    for col in ("case", "ok", "failed", "retries", "hedges", "p50 s", "p99 s", "p99.9 s", "p99 / healthy"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for name, r in results.items():
        lat = r["latency_s"]
        table.add_row(name, str(r["ok"]), str(r["failed"]), str(r["retries"]), str(r["hedges"]),
                      *(f"{lat[k]:.3f}" if lat[k] is not None else "-" for k in ("p50", "p99", "p99.9")),
                      f"{(lat['p99'] or 0) / base:.2f}x")
    console.print(table)
    out = Path(args.out or f"runs/sim-serve-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"rate_per_s": rate, "faults": [f.__dict__ for f in faults],
                                                  "results": results}, indent=2, default=str))
    console.print(f"results: {out / 'results.json'}")
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


def register_sim_serve(ssub: Any) -> None:
    from phalanx.serve.routing_policy import POLICY_NAMES, policy_help

    s = ssub.add_parser("serve", help="the router's policies at scale in virtual time (same seed, same result)")
    s.add_argument("--replicas", type=int, default=64)
    s.add_argument("--rate", type=float, default=None, help="Poisson req/s (default 70 %% of healthy capacity)")
    s.add_argument("--duration-s", type=float, default=30.0, help="virtual seconds of arrivals")
    s.add_argument("--service-ms", type=float, default=100.0, help="one request on a healthy replica")
    s.add_argument("--slots", type=int, default=1, help="requests a replica serves at once")
    s.add_argument("--fault-plan", default=None, help="serving fault plan (TOML), as `phalanx serve` takes")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--policy", default="all", choices=["all", *POLICY_NAMES],
                   help=policy_help("; all: each of them side by side (the default)"))
    s.add_argument("--out", default=None, help="run folder (default runs/sim-serve-TIMESTAMP)")
    s.set_defaults(fn=_sim_serve)
