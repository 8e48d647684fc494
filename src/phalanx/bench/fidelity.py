"""Fidelity: the same scenario (4 workers, the bundled model, one kill and one freeze) for real and
in the simulator, with the simulator's compute and collective costs calibrated from a fault-free
real run. Reports step, detection and recovery times side by side.

    python -m phalanx.bench fidelity [--steps 150] [--out runs/bench/fidelity.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

PLAN = ('[[fault]]\nkind = "kill"\nworker = 1\nat_step = 40\nrestart = true\n'
        '[[fault]]\nkind = "freeze"\nworker = 2\nat_step = 90\nfor_s = 3.0\n')


def _spans(run_dir: Path, name: str) -> list[float]:
    out = []
    for f in sorted((run_dir / "workers").glob("w*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("span") == name:
                out.append(float(rec["dur"]))
    return out


def _median_step(commits: list[Any]) -> float:
    return statistics.median(c.step_s if hasattr(c, "step_s") else c["step_s"] for c in commits[5:])


def main() -> int:
    from phalanx.bench.training import run_phalanx
    from phalanx.faults.plan import parse_fault_plan
    from phalanx.sim.cluster import Cluster
    from phalanx.sim.process_group import CollectiveModel

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", default="runs/bench/fidelity.json")
    args = ap.parse_args()
    console = Console(stderr=True)
    with tempfile.TemporaryDirectory() as tmp:
        console.print("real, fault-free (calibration) ...")
        calib = run_phalanx(4, args.steps, Path(tmp) / "calib")
        compute_s = statistics.median(_spans(Path(tmp) / "calib", "compute"))
        allreduce_s = statistics.median(_spans(Path(tmp) / "calib", "allreduce"))
        console.print("real, kill + freeze ...")
        real = run_phalanx(4, args.steps, Path(tmp) / "real", PLAN)
    # calibrate: compute per step, and an alpha that makes a 4-rank ring all-reduce cost what Gloo did
    alpha_s = allreduce_s / (2 * 3)
    sim = Cluster(workers=4, steps=args.steps, seed=1, plan=parse_fault_plan(PLAN, "<fidelity>"),
                  step_compute_s=compute_s, compute_jitter=0.05,
                  collective=CollectiveModel(alpha_s=alpha_s, beta_s_per_byte=0.0)).run().summary
    rows = [("median step (s)", _median_step(real.commits), sim["median_step_s"])]
    for i, kind in enumerate(("kill", "freeze")):
        rf, sf = real.faults[i], sim["faults"][i]
        rows.append((f"{kind}: detection (s)", rf["detected_after_s"], sf["detected_after_s"]))
        rows.append((f"{kind}: recovery (s)", rf["recovered_after_s"], sf["recovered_after_s"]))
    rows.append(("fault-free median step (s)", _median_step(calib.commits), None))
    t = Table(title="fidelity: real run vs calibrated simulation (4 workers, bundled model)")
    for c in ("measure", "real", "simulated", "sim / real"):
        t.add_column(c)
    table = []
    for name, r, s in rows:
        ratio = (s / r) if (r and s is not None) else None
        table.append({"measure": name, "real": r, "simulated": s, "ratio": ratio})
        t.add_row(name, f"{r:.4f}" if r is not None else "-", f"{s:.4f}" if s is not None else "-",
                  f"{ratio:.2f}" if ratio else "-")
    console.print(t)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"calibration": {"compute_s": compute_s, "allreduce_s": allreduce_s},
                               "rows": table}, indent=2))
    print(f"wrote {out}")
    return 0
