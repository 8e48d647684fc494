"""Training benchmark: phalanx strict mode vs plain torch DDP (Gloo), side by side in one run, plus
detection and recovery times for kill, freeze and GIL hang.

    python -m phalanx.bench training [--workers 4] [--steps 150] [--out runs/bench/training.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from phalanx.faults.plan import parse_fault_plan
from phalanx.runtime.launcher import LaunchConfig, launch, python_argv

WARMUP_STEPS = 10


def run_ddp(workers: int, steps: int) -> list[float]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ddp.json"
        procs = [subprocess.Popen([sys.executable, "-m", "phalanx.bench.ddp_worker", str(r), str(workers),
                                   str(store.port), str(steps), str(out)]) for r in range(workers)]
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise RuntimeError(f"DDP worker exited with {p.returncode}")
        return json.loads(out.read_text())["step_s"]


def run_phalanx(workers: int, steps: int, run_dir: Path, plan_text: str = "") -> Any:
    plan = parse_fault_plan(plan_text, "<bench>") if plan_text else None
    argv = python_argv("phalanx.workload.charlm_train", "--steps", str(steps))
    cfg = LaunchConfig(argv=argv, workers=workers, run_dir=run_dir, restart_failed=True, total_steps=steps,
                       show_progress=False, **({"fault_plan": plan} if plan else {}))
    res = launch(cfg)
    if not res.ok:
        raise RuntimeError(f"phalanx run failed: {res.reason}")
    return res


FAULTS = {
    "kill": '[[fault]]\nkind = "kill"\nworker = 1\nat_step = 30\nrestart = true\n',
    "freeze": '[[fault]]\nkind = "freeze"\nworker = 2\nat_step = 30\nfor_s = 3.0\n',
    "gil_hang": '[[fault]]\nkind = "gil_hang"\nworker = 3\nat_step = 30\nfor_s = 3.0\n',
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=2, help="alternating DDP/phalanx pairs")
    ap.add_argument("--out", default="runs/bench/training.json")
    args = ap.parse_args()
    con = Console(stderr=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ddp_med, phx_med = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):  # alternate so machine noise hits both sides alike
            con.print(f"[{i + 1}/{args.repeats}] plain DDP, {args.workers} workers, {args.steps} steps")
            ddp_med.append(statistics.median(run_ddp(args.workers, args.steps)[WARMUP_STEPS:]))
            con.print(f"[{i + 1}/{args.repeats}] phalanx strict, same model and batches")
            res = run_phalanx(args.workers, args.steps, Path(tmp) / f"phx{i}")
            phx_med.append(statistics.median([c.step_s for c in res.commits][WARMUP_STEPS:]))
        faults = {}
        for kind, text in FAULTS.items():
            con.print(f"fault run: {kind}")
            res = run_phalanx(args.workers, 60, Path(tmp) / f"fault-{kind}", text)
            faults[kind] = res.faults[0] if res.faults else None
    ddp_s, phx_s = min(ddp_med), min(phx_med)
    result = {
        "command": "python -m phalanx.bench training " + " ".join(sys.argv[1:]),
        "workers": args.workers, "steps": args.steps,
        "ddp_step_s_median": ddp_s, "phalanx_step_s_median": phx_s,
        "overhead_ratio": phx_s / ddp_s, "overhead_pct": 100 * (phx_s / ddp_s - 1),
        "runs": {"ddp": ddp_med, "phalanx": phx_med},
        "faults": faults,
        "unix_s": time.time(),
    }
    out.write_text(json.dumps(result, indent=2))
    t = Table(title="phalanx vs plain DDP (Gloo), bundled model")
    t.add_column("measure")
    t.add_column("value")
    t.add_row("DDP step (median)", f"{ddp_s * 1000:.1f} ms")
    t.add_row("phalanx strict step (median)", f"{phx_s * 1000:.1f} ms")
    t.add_row("overhead", f"{result['overhead_pct']:+.1f} %")
    for kind, f in faults.items():
        if f:
            t.add_row(f"{kind}: detected / recovered", f"{f['detected_after_s']} s / {f['recovered_after_s']} s")
    Console().print(t)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
