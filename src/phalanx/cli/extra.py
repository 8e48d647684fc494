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


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("report", help="write a run's report.html and trace.json, or compare two runs",
                       description="With one run folder: (re)write RUN_DIR/report.html (self-contained, opens "
                                   "offline) and RUN_DIR/trace.json (open in Perfetto). With two: write an HTML "
                                   "comparison of the runs (default RUN_DIR2/compare.html).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="run folder written by `phalanx train` or the simulator")
    p.add_argument("run_dir2", metavar="RUN_DIR2", nargs="?", help="second run folder to compare against")
    p.add_argument("--out", metavar="FILE", help="HTML file to write instead of the default")
    p.set_defaults(fn=_report)
