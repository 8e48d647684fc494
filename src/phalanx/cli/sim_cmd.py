"""``phalanx sim run`` and ``phalanx sim sweep``: argument parsing and printing only."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    sim = sub.add_parser("sim", help="deterministic cluster simulator running the real protocol code",
                         description="Run phalanx's own coordinator and worker protocol on simulated machines "
                                     "in virtual time: seeded, replayable.")
    ssub = sim.add_subparsers(dest="sim_cmd", required=True)
    from phalanx.cli.serve_cmd import register_sim_serve

    register_sim_serve(ssub)  # `phalanx sim serve`: the router's decisions in virtual time (serve_cmd.py)
    r = ssub.add_parser("run", help="run one scenario")
    r.add_argument("--workers", type=int, default=64)
    r.add_argument("--steps", type=int, default=100)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--fault-plan", help="TOML fault plan (the format real runs take, plus network faults)")
    r.add_argument("--step-compute-s", type=float, default=0.05, help="compute per step at full world (default 0.05)")
    r.add_argument("--racks", type=int, default=1, help="racks under a spine (cross-rack links are slower)")
    r.add_argument("--out", help="run folder (default runs/sim-TIMESTAMP)")
    r.add_argument("--no-baseline", action="store_true", help="skip the fault-free run used for goodput")
    r.add_argument("--gradient-bytes", type=float, default=0,
                   help="charge all-reduces for a model of this many gradient bytes, e.g. 14e9 for 7B "
                        "params in fp16 (sizes only; the arithmetic stays on the small model)")
    r.add_argument("--mode", default="strict", choices=["strict", "available", "local-sgd"],
                   help="consistency mode of the simulated run (default strict)")
    r.set_defaults(fn=_run)
    sw = ssub.add_parser("sweep", help="random fault schedules over many seeds, invariants checked")
    sw.add_argument("--seeds", type=int, default=20)
    sw.add_argument("--first-seed", type=int, default=0)
    sw.add_argument("--workers", type=int, default=8)
    sw.add_argument("--steps", type=int, default=40)
    sw.add_argument("--max-faults", type=int, default=4, help="each schedule draws 1..N faults (default 4)")
    sw.add_argument("--out", default="runs/sweep")
    sw.add_argument("--mode", default="strict", choices=["strict", "available", "local-sgd"],
                    help="consistency mode of every seed (default strict)")
    sw.add_argument("--checkpoint-every", type=int, default=0,
                    help="durable (in-memory) checkpoints every K steps (default 0: only the last step)")
    sw.set_defaults(fn=_sweep)


def _run(args: argparse.Namespace) -> int:
    from phalanx.faults.plan import EMPTY_PLAN, load_fault_plan
    from phalanx.core.modes import ModeConfig
    from phalanx.sim.cluster import Cluster
    from phalanx.sim.output import write_run

    plan = load_fault_plan(args.fault_plan) if args.fault_plan else EMPTY_PLAN
    out = Path(args.out or f"runs/sim-{time.strftime('%Y%m%d-%H%M%S')}")

    def cluster(p: object) -> Cluster:
        return Cluster(workers=args.workers, steps=args.steps, seed=args.seed, plan=p,  # type: ignore[arg-type]
                       step_compute_s=args.step_compute_s, racks=args.racks,
                       gradient_bytes=int(args.gradient_bytes),
                       modes=ModeConfig(mode=ModeConfig.parse(args.mode)))

    print(f"simulating {args.workers} workers x {args.steps} steps, seed {args.seed}, plan {plan.name} ...",
          file=sys.stderr, flush=True)
    res = cluster(plan).run()
    extra = {}
    if plan.faults and not args.no_baseline:
        print("fault-free baseline ...", file=sys.stderr, flush=True)
        base = cluster(EMPTY_PLAN).run().summary
        g, g0 = res.summary["goodput_steps_per_virtual_s"], base["goodput_steps_per_virtual_s"]
        extra = {"baseline_goodput_steps_per_virtual_s": g0, "goodput_vs_fault_free": round(g / g0, 4) if g0 else None}
    write_run(res, out, extra)
    from phalanx.obs.report import write_report

    write_report(out)  # report.html + trace.json: the same tools read real and simulated runs
    s = {**res.summary, **extra}
    _print_summary(s, out)
    return 0 if res.ok else 1


def _print_summary(s: dict, out: Path) -> None:  # type: ignore[type-arg]
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"simulated run: {'OK' if s['ok'] else 'FAILED'}")
    t.add_column("measure")
    t.add_column("value")
    rows = [("workers x steps", f"{s['workers']} x {s['steps']}"), ("steps committed", s["steps_committed"]),
            ("steps rolled back", s["steps_retried"]), ("virtual time", f"{s['virtual_s']:.3f} s"),
            ("wall time", f"{s['wall_s']:.2f} s"), ("goodput", f"{s['goodput_steps_per_virtual_s']} steps/virtual s"),
            ("goodput vs fault-free", s.get("goodput_vs_fault_free", "-")),
            ("samples exactly once", s["samples_exactly_once"]),
            ("max |params - reference|", s["reference_max_abs_diff"]), ("invariant violations", len(s["violations"]))]
    for f in s["faults"]:
        rows.append((f["description"], f"detected {_secs(f['detected_after_s'])}, "
                                       f"recovered {_secs(f['recovered_after_s'])}"))
    for k, v in rows:
        t.add_row(str(k), str(v))
    Console(stderr=True).print(t)
    if not s["ok"]:
        print(f"phalanx sim: FAILED: {s['reason']}", file=sys.stderr)
    print(json.dumps({"run_dir": str(out), "ok": s["ok"], "trace_digest": s.get("trace_digest")}))


def _sweep(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from phalanx.core.modes import ModeConfig
    from phalanx.sim.sweep import SweepShape, replay_command, sweep

    failed = []
    with Progress(transient=True) as prog:
        task = prog.add_task(f"sweep {args.seeds} seeds", total=args.seeds)

        def on_seed(o) -> None:  # type: ignore[no-untyped-def]
            prog.advance(task)
            if not o.ok:
                failed.append(o)
                prog.console.print(f"seed {o.seed} FAILED: {o.reason}\n  replay: "
                                   f"{replay_command(o, args.workers, args.steps)}")

        outcomes = sweep(range(args.first_seed, args.first_seed + args.seeds), args.workers, args.steps,
                         Path(args.out), on_seed, max_faults=args.max_faults,
                         shape=SweepShape(ModeConfig(mode=ModeConfig.parse(args.mode)), args.checkpoint_every))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sweep.json").write_text(json.dumps(
        [{"seed": o.seed, "ok": o.ok, "reason": o.reason, "faults": o.faults, "shrunk": o.shrunk,
          "plan": o.plan_path} for o in outcomes], indent=2))
    stopped = sum(1 for o in outcomes if o.expected_stop)
    note = f", {stopped} of them by stopping as they should: every holder of the state was killed" if stopped else ""
    print(f"phalanx sim sweep: {len(outcomes) - len(failed)} of {len(outcomes)} seeds passed{note} "
          f"({args.workers} workers x {args.steps} steps each); results in {args.out}/sweep.json")
    return 1 if failed else 0


def _secs(v: float | None) -> str:
    """A fault's time, or "-" where there is none (a join has nothing to detect; a fault still
    unrecovered when the run ended)."""
    return "-" if v is None else f"{v:.4f} s"
