"""What each consistency mode bought and cost in one run, read back from its run folder.

The same definitions for every mode, so ``--compare-modes`` rows are comparable:
- throughput: samples trained per second over the training window (first to last commit, or to
  the last local step in local-sgd);
- time to target loss: from the first commit until the run's smoothed training loss first reaches
  the reference's smoothed loss at 75 % of the steps;
- stall: time in progress gaps longer than 3x the median gap (the excess only);
- final loss: the final parameters' loss on a fixed evaluation batch, next to the reference's.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EVAL_SAMPLES = 256
SMOOTH_STEPS = 10


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a JSON-lines file, one at a time (none if it does not exist)."""
    if not path.exists():
        return
    with open(path) as f:
        for x in f:
            if x.strip():
                yield json.loads(x)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return list(iter_jsonl(path))


def progress_timeline(run_dir: Path, mode: str, global_batch_size: int) -> tuple[list[float], list[float], int]:
    """(times_s from the first commit, losses, samples trained) of the run's progress."""
    if mode != "local-sgd":
        # streamed: two floats per commit are kept, not the records
        times: list[float] = []
        losses: list[float] = []
        t0 = 0.0
        for c in iter_jsonl(run_dir / "metrics.jsonl"):
            if not times:
                t0 = c["committed_at_s"] - c["step_s"]
            times.append(c["committed_at_s"] - t0)
            losses.append(c["loss"])
        return times, losses, len(times) * global_batch_size
    events = []
    for p in sorted((run_dir / "workers").glob("w*.jsonl")):
        events += [e for e in read_jsonl(p) if e.get("event") in ("local_step", "merged")]
    steps = sorted((e for e in events if e["event"] == "local_step"), key=lambda e: e["mono"])
    merges = [e["mono"] for e in events if e["event"] == "merged"]
    if not steps:
        return [], [], 0
    t0 = min(merges) if merges else steps[0]["mono"]
    return [e["mono"] - t0 for e in steps], [e["loss"] for e in steps], sum(e["samples"] for e in steps)


def _smooth(xs: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def stall_s(times: list[float]) -> float:
    gaps = [b - a for a, b in zip(times, times[1:])]
    if len(gaps) < 3:
        return 0.0
    med = statistics.median(gaps)
    return sum(g - 3 * med for g in gaps if g > 3 * med)


def max_staleness(run_dir: Path) -> int:
    worst = 0
    for p in sorted((run_dir / "workers").glob("w*.jsonl")):
        worst = max([worst, *(e["staleness"] for e in read_jsonl(p) if e.get("event") == "local_step")])
    return worst


def eval_loss(params: dict[str, Any], seed: int, global_batch_size: int) -> float:
    import torch

    from phalanx.workload.charlm_train import build
    from phalanx.workload.model import build_model, loss_fn

    cfg, data = build(seed=seed, global_batch_size=global_batch_size)
    model = build_model(cfg)
    model.load_state_dict(params)
    g = torch.Generator().manual_seed(10_000 + seed)
    idx = torch.randperm(len(data), generator=g)[:EVAL_SAMPLES].numpy()
    x, y = data.batch(idx)
    with torch.no_grad():
        return float(loss_fn(model(x), y))


def mode_metrics(run_dir: Path, mode: str, steps: int, seed: int, global_batch_size: int, workers: int,
                 reference_losses: list[float] | None, reference_params: dict[str, Any] | None) -> dict[str, Any]:
    from phalanx.checkpoint.durable import read_tensors_file

    times, losses, samples = progress_timeline(run_dir, mode, global_batch_size)
    window_s = times[-1] if times else 0.0
    out: dict[str, Any] = {
        "mode": mode,
        "samples_trained": samples,
        "throughput_samples_per_s": round(samples / window_s, 2) if window_s > 0 else None,
        "stall_s": round(stall_s(times) if mode != "local-sgd" else _per_worker_stall(run_dir), 3),
        "time_to_target_loss_s": None,
        "target_loss": None,
    }
    if reference_losses:
        ref_smooth = _smooth(reference_losses, SMOOTH_STEPS)
        target = ref_smooth[min(len(ref_smooth) - 1, int(0.75 * steps))]
        window = SMOOTH_STEPS * (workers if mode == "local-sgd" else 1)
        hit = next((t for t, x in zip(times, _smooth(losses, window)) if x <= target), None)
        out["target_loss"] = round(target, 4)
        out["time_to_target_loss_s"] = None if hit is None else round(hit, 3)
    finals = sorted(run_dir.glob("final_*.safetensors"))
    if finals:
        params = read_tensors_file(finals[0])
        out["final_eval_loss"] = round(eval_loss(params, seed, global_batch_size), 4)
    if reference_params is not None:
        out["reference_eval_loss"] = round(eval_loss(reference_params, seed, global_batch_size), 4)
    if mode == "local-sgd":
        out["max_staleness_steps"] = max_staleness(run_dir)
    return out


def _per_worker_stall(run_dir: Path) -> float:
    stalls = []
    for p in sorted((run_dir / "workers").glob("w*.jsonl")):
        ts = [e["mono"] for e in read_jsonl(p) if e.get("event") == "local_step"]
        if ts:
            stalls.append(stall_s(ts))
    return sum(stalls) / len(stalls) if stalls else 0.0
