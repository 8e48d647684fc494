"""Coordinator memory over a long simulated run: the commit history as a bounded ring plus the log
on disk, against an unbounded in-memory history (what the coordinator kept before issue 14).

    python -m phalanx.bench.commit_history [--steps 100000] [--workers 2] [--kept 64]

Each variant runs in a fresh process (same seed, same cluster) while a thread samples the
process's RSS against the steps committed so far. The simulator keeps per-step bookkeeping of its
own (checker state, the event list), the same in both variants, so the difference between the two
curves is what the coordinator's history costs; the absolute figures include the simulator's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def run_variant(steps: int, workers: int, kept: int, log: str) -> dict[str, Any]:
    """One simulated run in this process; (steps committed, RSS KiB) samples while it runs."""
    from phalanx.sim.cluster import Cluster

    cluster = Cluster(workers=workers, steps=steps, seed=1, record_spans=False, commits_kept=kept, commit_log=log,
                      max_virtual_s=10.0 * steps)
    samples: list[tuple[int, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            coord = getattr(cluster, "coord", None)
            if coord is not None:
                samples.append((coord.commits_total, _rss_kib()))

    t = threading.Thread(target=sample, daemon=True)
    rss_start = _rss_kib()
    t0 = time.perf_counter()
    t.start()
    result = cluster.run()
    stop.set()
    t.join(5)
    return {"steps": steps, "workers": workers, "kept": kept, "log": bool(log), "ok": result.ok,
            "commits": len(result.commits), "wall_s": round(time.perf_counter() - t0, 1), "rss_start_kib": rss_start,
            "in_memory_records": len(cluster.coord.commits), "samples": samples}


def _at(samples: list[list[int]], frac: float, steps: int) -> int | None:
    """RSS (KiB) at the first sample past frac * steps committed."""
    return next((rss for n, rss in samples if n >= frac * steps), None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kept", type=int, default=64)
    ap.add_argument("--variant", choices=("bounded", "unbounded"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default="runs/bench/commit_history.json")
    args = ap.parse_args()
    if args.variant:  # the child: one run, JSON on stdout
        with tempfile.TemporaryDirectory() as tmp:
            log = str(Path(tmp) / "commits.jsonl") if args.variant == "bounded" else ""
            kept = args.kept if args.variant == "bounded" else 10**12
            print(json.dumps(run_variant(args.steps, args.workers, kept, log)))
        return 0
    runs = {}
    for variant in ("bounded", "unbounded"):
        out = subprocess.run([sys.executable, "-m", "phalanx.bench.commit_history", "--variant", variant,
                              "--steps", str(args.steps), "--workers", str(args.workers), "--kept", str(args.kept)],
                             check=True, capture_output=True, text=True, timeout=7200)
        runs[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    rows = []
    for frac in (0.25, 0.5, 0.75, 1.0):
        b, u = (_at(runs[v]["samples"], frac, args.steps) for v in ("bounded", "unbounded"))
        rows.append({"steps_committed": int(frac * args.steps), "bounded_rss_mib": b and round(b / 1024, 1),
                     "unbounded_rss_mib": u and round(u / 1024, 1),
                     "difference_mib": round((u - b) / 1024, 1) if b and u else None})
    report = {"steps": args.steps, "workers": args.workers, "kept": args.kept, "rows": rows,
              "runs": {k: {x: y for x, y in v.items() if x != "samples"} for k, v in runs.items()},
              "samples": {k: v["samples"] for k, v in runs.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{'steps committed':>16} {'ring + log (MiB)':>17} {'unbounded (MiB)':>16} {'difference':>11}")
    for r in rows:
        print(f"{r['steps_committed']:>16} {r['bounded_rss_mib']!s:>17} {r['unbounded_rss_mib']!s:>16} "
              f"{r['difference_mib']!s:>11}")
    print(json.dumps(report["runs"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
