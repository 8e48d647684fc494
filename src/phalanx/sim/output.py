"""Writes a simulated run in the same folder layout as a real run (summary.json, metrics.jsonl,
events.jsonl, workers/wN.jsonl), so the same tools (``phalanx report``) read both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from phalanx.sim.cluster import SimResult


def write_run(res: SimResult, run_dir: Path, extra: dict[str, Any] | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = {**res.summary, "trace_digest": res.digest, **(extra or {})}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    with open(run_dir / "metrics.jsonl", "w") as f:
        for c in res.commits:
            f.write(json.dumps(c) + "\n")
    with open(run_dir / "events.jsonl", "w") as f:
        for e in res.events:
            f.write(json.dumps(e, default=str) + "\n")
    if res.spans:
        (run_dir / "workers").mkdir(exist_ok=True)
        by_worker: dict[str, list[str]] = {}
        for s in res.spans:
            by_worker.setdefault(s["node"], []).append(json.dumps(s))
        for w in sorted(by_worker):
            (run_dir / "workers" / f"{w}.jsonl").write_text("\n".join(by_worker[w]) + "\n")
    return run_dir
