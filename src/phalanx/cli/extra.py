"""Subcommands added by later layers (report, sim). Each registers itself here."""

from __future__ import annotations

import argparse
from pathlib import Path


def _report(args: argparse.Namespace) -> int:
    """One run folder: regenerate its report and trace. Two: compare them. Errors are ConfigErrors (exit 2)."""
    from phalanx.obs.report import compare_runs, write_report

    out = Path(args.out) if args.out else None
    if args.run_dir2:
        print(compare_runs(Path(args.run_dir), Path(args.run_dir2), out))
        return 0
    res = write_report(Path(args.run_dir), out)
    print(res["report"])
    print(res["trace"])
    return 0


def _soak(args: argparse.Namespace) -> int:
    import json
    import time

    from phalanx.runtime.soak import run_soak

    out = Path(args.out or f"runs/soak-{time.strftime('%Y%m%d-%H%M%S')}")
    res = run_soak(args.duration_s, out, seed=args.seed, show_progress=not args.quiet)
    print(json.dumps(res, indent=2))
    print(f"phalanx soak: {'OK' if res['ok'] else 'FAILED'}; {out / 'soak.md'}")
    return 0 if res["ok"] else 1


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    k = sub.add_parser("soak", help="a long 4-worker job through random faults and hostile connections, then checks",
                       description="Random faults (kill, freeze, gil_hang, hang, partition, loss, latency, "
                                   "coordinator_kill) one at a time, hostile connections at every listening port, "
                                   "then: every sample once, equality with the reference, no leaked process, fd or "
                                   "temp file, memory flat after warm-up. Writes soak.json and soak.md.")
    k.add_argument("--duration-s", type=float, default=1800.0, help="how long (default 1800)")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--out", help="run folder (default runs/soak-TIMESTAMP)")
    k.add_argument("--quiet", action="store_true")
    k.set_defaults(fn=_soak)
    p = sub.add_parser("report", help="write a run's report.html and trace.json, or compare two runs",
                       description="With one run folder: (re)write RUN_DIR/report.html (self-contained, opens "
                                   "offline) and RUN_DIR/trace.json (open in Perfetto). With two: write an HTML "
                                   "comparison of the runs (default RUN_DIR2/compare.html).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="run folder written by `phalanx train` or the simulator")
    p.add_argument("run_dir2", metavar="RUN_DIR2", nargs="?", help="second run folder to compare against")
    p.add_argument("--out", metavar="FILE", help="HTML file to write instead of the default")
    p.set_defaults(fn=_report)
