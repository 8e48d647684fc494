"""The ``phalanx`` command. Argument parsing and printing only; the work lives in runtime/."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from phalanx.core.errors import PhalanxError


def _train(args: argparse.Namespace) -> int:
    from phalanx.faults.plan import default_plan_path, load_fault_plan
    from phalanx.runtime.train_job import TrainOptions, run_train

    from phalanx.core.modes import ModeConfig

    plan = None if args.no_faults else load_fault_plan(args.fault_plan or default_plan_path())
    run_dir = Path(args.out or f"runs/{'compare' if args.compare_modes else 'train'}-{time.strftime('%Y%m%d-%H%M%S')}")
    modes = ModeConfig(mode=ModeConfig.parse(args.mode), deadline_s=args.deadline_s,
                       sync_every_steps=args.sync_every, max_staleness_steps=args.max_staleness)
    opts = TrainOptions(workers=args.workers, steps=args.steps, seed=args.seed, run_dir=run_dir,
                        fault_plan=plan, checkpoint_every_steps=args.checkpoint_every,
                        resume=args.resume, reference=not args.no_reference,
                        show_progress=not args.quiet, min_step_s=args.min_step_s, modes=modes,
                        network=args.network)
    if args.compare_modes:
        return _compare(opts)
    summary = run_train(opts)
    from phalanx.cli.printing import print_summary

    print_summary(summary, run_dir)
    if not summary["ok"]:
        print(f"phalanx train: FAILED: {summary.get('reason') or 'strict checks did not hold'}", file=sys.stderr)
        return 1
    return 0


def _compare(opts: Any) -> int:
    from phalanx.cli.printing import print_mode_row, print_mode_table
    from phalanx.runtime.compare_modes import compare_modes

    result = compare_modes(opts, on_row=print_mode_row)
    print_mode_table(result["rows"], opts.run_dir)
    return 0 if all(r["ok"] for r in result["rows"]) else 1


def _launch(args: argparse.Namespace) -> int:
    from phalanx.faults.plan import EMPTY_PLAN, load_fault_plan
    from phalanx.runtime.launcher import LaunchConfig, launch, write_metrics

    cmd = args.command
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise PhalanxError("nothing to run: give the worker command after --, e.g. `phalanx launch -- python train.py`")
    if args.coordinator and not args.token_file:
        raise PhalanxError("--coordinator needs --token-file: multi-machine runs must share a cluster token")
    plan = load_fault_plan(args.fault_plan) if args.fault_plan else EMPTY_PLAN
    plan.validate_workers(args.workers)
    plan.require_supported("real")
    run_dir = Path(args.resume or args.run_dir or f"runs/launch-{time.strftime('%Y%m%d-%H%M%S')}")
    res = launch(LaunchConfig(argv=cmd, workers=args.workers, run_dir=run_dir, fault_plan=plan,
                              restart_failed=args.restart_failed, coordinator=args.coordinator or "",
                              token_file=args.token_file or "", resume=bool(args.resume),
                              checkpoint_every_steps=args.checkpoint_every, min_workers=args.min_workers))
    write_metrics(run_dir, res.commits, append=bool(args.resume))
    (run_dir / "launch.json").write_text(json.dumps({"ok": res.ok, "reason": res.reason, "wall_s": res.wall_s,
                                                     "steps_committed": len(res.commits),
                                                     "steps_retried": res.steps_retried, "faults": res.faults},
                                                    indent=2))
    if not res.ok:
        print(f"phalanx launch: {res.reason}", file=sys.stderr)
        return 1
    print(f"phalanx launch: {len(res.commits)} steps committed, {res.steps_retried} retried, run folder {run_dir}")
    return 0


def _coordinator(args: argparse.Namespace) -> int:
    from phalanx.runtime.standalone import run_coordinator

    return run_coordinator(args.bind, args.token_file, args.workers, Path(args.run_dir))


def _token(args: argparse.Namespace) -> int:
    from phalanx.core.auth import generate_token, write_token_file

    if args.out:
        write_token_file(args.out, generate_token())  # 0600, O_EXCL | O_NOFOLLOW
        print(f"wrote a new cluster token to {args.out} (mode 600)")
        return 0
    print("phalanx token: printing to stdout; prefer `phalanx token --out FILE` (created mode 600, never "
          "overwritten): a shell redirect creates a file others may read", file=sys.stderr)
    print(generate_token().decode())
    return 0


def _tls_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS between machines (mutual; all three, or PHALANX_TLS_CERT/KEY/CA)")
    g.add_argument("--tls-cert", help="this node's certificate (PEM), signed by the cluster CA")
    g.add_argument("--tls-key", help="its private key (PEM)")
    g.add_argument("--tls-ca", help="the cluster CA certificate (PEM) every peer's certificate must chain to")


def _export_tls(args: argparse.Namespace) -> None:
    """TLS flags travel as PHALANX_TLS_* to this process's transport and to every worker."""
    for flag, name in (("tls_cert", "PHALANX_TLS_CERT"), ("tls_key", "PHALANX_TLS_KEY"), ("tls_ca", "PHALANX_TLS_CA")):
        if getattr(args, flag, None):
            os.environ[name] = str(Path(getattr(args, flag)).resolve())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="phalanx", description="Fault-tolerant distributed PyTorch training.")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="the main job: train the bundled model on local workers through a fault plan",
                       description="Train the bundled char-level transformer on N local worker processes through "
                                   "a fault plan (default: kill+restart, freeze, GIL hang), then run the fault-free "
                                   "single-process reference over the same batches and compare.")
    t.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    t.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    t.add_argument("--fault-plan", help="TOML fault plan (default: the bundled faults/plans/default.toml)")
    t.add_argument("--no-faults", action="store_true", help="run fault-free")
    t.add_argument("--out", help="run folder (default runs/train-TIMESTAMP)")
    t.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    t.add_argument("--checkpoint-every", type=int, default=50, help="durable checkpoint every K steps (0: never)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    t.add_argument("--no-reference", action="store_true", help="skip the single-process reference comparison")
    t.add_argument("--quiet", action="store_true", help="no live progress display")
    t.add_argument("--min-step-s", type=float, default=0.0,
                   help="pace each step to at least this many seconds (emulates a larger model; default 0)")
    t.add_argument("--network", default="loopback", choices=["loopback", "namespaces"],
                   help="loopback (default), or namespaces: each worker in its own network namespace behind a "
                        "bridge, partition/bandwidth faults in the kernel (needs root)")
    t.add_argument("--mode", default="strict", choices=["strict", "available", "local-sgd"],
                   help="consistency mode (default strict; see docs/ARCHITECTURE.md, Consistency modes)")
    t.add_argument("--deadline-s", type=float, default=0.25,
                   help="available: how long a step waits for members that have not turned up, at least; at long "
                        "steps the deadline is one recent step time (default 0.25)")
    t.add_argument("--sync-every", type=int, default=10, help="local-sgd: local steps between merges (default 10)")
    t.add_argument("--max-staleness", type=int, default=30,
                   help="local-sgd: local steps past the last merge before a worker blocks (default 30)")
    t.add_argument("--compare-modes", action="store_true",
                   help="run the fault plan under every mode (plus a fault-free baseline) and print the table")
    t.set_defaults(fn=_train)

    la = sub.add_parser("launch", help="run a training script on N supervised workers",
                        description="Start an embedded coordinator (or use --coordinator) and N worker processes "
                                    "running COMMAND, which uses phalanx.join().")
    la.add_argument("--workers", type=int, default=2)
    la.add_argument("--fault-plan")
    la.add_argument("--restart-failed", action="store_true", help="restart a worker that exits non-zero")
    la.add_argument("--coordinator", help="HOST:PORT of a `phalanx coordinator` (multi-machine)")
    la.add_argument("--token-file", help="cluster token file (required with --coordinator)")
    la.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its newest valid checkpoint")
    la.add_argument("--run-dir", help="run folder (default runs/launch-TIMESTAMP)")
    la.add_argument("--checkpoint-every", type=int, default=0)
    la.add_argument("--min-workers", type=int, default=1)
    _tls_flags(la)
    la.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS")
    la.set_defaults(fn=_launch)

    c = sub.add_parser("coordinator", help="run a standalone coordinator for multi-machine jobs")
    c.add_argument("--bind", required=True, help="HOST:PORT to listen on")
    c.add_argument("--token-file", required=True)
    c.add_argument("--workers", type=int, default=1, help="workers the first quorum waits for")
    c.add_argument("--run-dir", default="runs/coordinator")
    _tls_flags(c)
    c.set_defaults(fn=_coordinator)

    tk = sub.add_parser("token", help="a fresh cluster token: --out FILE writes it mode 600 (never overwrites)")
    tk.add_argument("--out", help="create this file (mode 600, O_EXCL|O_NOFOLLOW) instead of printing")
    tk.set_defaults(fn=_token)
    from phalanx.cli import extra, lab_cmd, serve_cmd, sim_cmd

    sim_cmd.register(sub)
    lab_cmd.register(sub)
    extra.register(sub)
    serve_cmd.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _export_tls(args)
    try:
        return int(args.fn(args) or 0)
    except PhalanxError as e:
        print(f"phalanx: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("phalanx: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
