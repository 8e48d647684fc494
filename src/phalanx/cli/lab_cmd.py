"""``phalanx lab``: argument parsing and printing only; the experiments live in phalanx.lab."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from phalanx.lab.outcome import Outcome
    from phalanx.lab.registry import Experiment


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("lab", help="experiments: watch each idea of distributed systems happen on phalanx",
                       description="`phalanx lab` lists the experiments; `phalanx lab NAME` runs one on real local "
                                   "processes (--sim: in the simulator) and writes DIR/report.html; "
                                   "`phalanx lab all --quick` runs every one in its short form.")
    p.add_argument("name", nargs="?", help="experiment to run, or `all` (none: list them)")
    p.add_argument("--sim", action="store_true", help="run in the deterministic simulator")
    p.add_argument("--real", action="store_true", help="real processes even where the simulator is the default")
    p.add_argument("--quick", action="store_true", help="the short form (all of them in <= 5 minutes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="report folder (default runs/lab/NAME-TIMESTAMP)")
    p.set_defaults(fn=_lab)


def _lab(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from phalanx.lab.outcome import print_outcome
    from phalanx.lab.registry import EXPERIMENTS
    from phalanx.lab.runner import LabRequest, run_all, run_named

    console = Console()
    if not args.name:
        _list(console, EXPERIMENTS)
        return 0
    req = LabRequest(sim=args.sim, real=args.real, quick=args.quick, seed=args.seed,
                     out=Path(args.out) if args.out else None)

    def say(msg: str) -> None:
        console.print(f"[dim]{escape(msg)}[/dim]")

    if args.name != "all":
        with console.status(f"phalanx lab {args.name} ..."):
            outcome, out_dir = run_named(args.name, req, say)
        print_outcome(outcome, out_dir)
        return 0 if outcome.claim_held else 1
    done = run_all(req, say, lambda o, d: print_outcome(o, d))
    _print_all(console, done)
    return 0 if all(o.claim_held for o, _ in done) else 1


def _list(console: Console, experiments: tuple[Experiment, ...]) -> None:
    from rich.table import Table

    t = Table(title="phalanx lab: `phalanx lab NAME [--sim] [--quick]`, or `phalanx lab all --quick`")
    t.add_column("experiment")
    t.add_column("what it shows")
    t.add_column("default")
    for e in experiments:
        t.add_row(e.name, e.summary, e.where or ("simulator" if e.sim_by_default else
                                                 "real processes" + (" (--quick: simulator)" if e.quick_sim else "")))
    console.print(t)


def _print_all(console: Console, done: list[tuple[Outcome, Path]]) -> None:
    from rich.table import Table

    t = Table(title="phalanx lab all")
    for c in ("experiment", "claim", "wall (s)", "report"):
        t.add_column(c)
    for o, d in done:
        t.add_row(o.name, "held" if o.claim_held else "DID NOT HOLD", f"{o.wall_s:.1f}", str(d / "report.html"))
    console.print(t)
    total = sum(o.wall_s for o, _ in done)
    print(json.dumps({"experiments": len(done), "claims_held": sum(o.claim_held for o, _ in done),
                      "wall_s": round(total, 1)}), file=sys.stderr)
