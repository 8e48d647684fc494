"""``phalanx train``: the main job. The bundled model on N local workers through a fault plan,
then the fault-free single-process reference over the same batches, compared and summarised."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.core.modes import ConsistencyMode, ModeConfig
from phalanx.faults.plan import FaultPlan
from phalanx.runtime.run_dir import claim_run_dir, clear_run_outputs
from phalanx.runtime.launcher import LaunchConfig, LaunchResult, launch, python_argv, write_metrics
from phalanx.train import sharding

STRICT_TOLERANCE = 1e-5


@dataclass
class TrainOptions:
    workers: int = 4
    steps: int = 200
    seed: int = 0
    run_dir: Path = Path("runs/train")
    fault_plan: FaultPlan | None = None
    checkpoint_every_steps: int = 50
    resume: bool = False
    reference: bool = True
    show_progress: bool = True
    global_batch_size: int = 32
    min_step_s: float = 0.0  # pace steps (emulated compute); the reference is unaffected
    modes: ModeConfig = ModeConfig()  # consistency mode (core.modes): strict, available, local-sgd
    report: bool = True  # write report.html and trace.json into the run folder at the end
    network: str = "loopback"  # or "namespaces": each worker in its own network namespace (root only)
    commits_kept: int = 4096  # commit records the coordinator keeps in memory (all are in RUN/commits.jsonl)


def run_train(opts: TrainOptions) -> dict[str, Any]:
    from phalanx.faults.plan import EMPTY_PLAN

    t0 = time.monotonic()
    plan = opts.fault_plan or EMPTY_PLAN
    plan.validate_workers(opts.workers)
    plan.require_supported("real")
    if opts.resume:
        _supersede_after_checkpoint(opts.run_dir)
    else:
        claim_run_dir(opts.run_dir)  # refuses a non-empty folder phalanx did not create
        clear_run_outputs(opts.run_dir)
    argv = python_argv("phalanx.workload.charlm_train", "--steps", str(opts.steps), "--seed", str(opts.seed),
                       "--global-batch-size", str(opts.global_batch_size), "--min-step-s", str(opts.min_step_s))
    res = launch(LaunchConfig(argv=argv, workers=opts.workers, run_dir=opts.run_dir, fault_plan=plan,
                              restart_failed=True, resume=opts.resume, total_steps=opts.steps,
                              checkpoint_every_steps=opts.checkpoint_every_steps, data_seed=opts.seed,
                              show_progress=opts.show_progress, modes=opts.modes,
                              network=opts.network, commits_kept=opts.commits_kept))
    write_metrics(opts.run_dir, res.commits, append=opts.resume)
    summary = summarise(opts, res)
    ref = None
    if opts.reference and res.ok:
        ref_summary, ref = compare_with_reference(opts)
        summary.update(ref_summary)
        with open(opts.run_dir / "reference.jsonl", "w") as f:
            f.writelines(json.dumps({"step": i, "loss": x}) + "\n" for i, x in enumerate(ref.losses))
    from phalanx.runtime.mode_metrics import mode_metrics

    summary["mode_metrics"] = mode_metrics(opts.run_dir, opts.modes.mode.value, opts.steps, opts.seed,
                                           opts.global_batch_size, opts.workers,
                                           ref.losses if ref else None, ref.params if ref else None)
    summary["wall_s"] = round(time.monotonic() - t0, 3)
    summary["ok"], why = _guarantee_held(opts, res.ok, summary)
    if res.ok and not summary["ok"]:
        summary["reason"] = why
    (opts.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if opts.report:
        from phalanx.obs.report import write_report

        write_report(opts.run_dir)
    return summary


def _guarantee_held(opts: TrainOptions, launched_ok: bool, summary: dict[str, Any]) -> tuple[bool, str]:
    """Each mode's own guarantee: strict = equality with the reference and exactly-once samples;
    available = exactly-once samples (the difference from the reference is reported, not required);
    local-sgd = the staleness bound."""
    if not launched_ok:
        return False, summary.get("reason", "")
    mode = opts.modes.mode
    if mode is ConsistencyMode.LOCAL_SGD:
        worst = summary["mode_metrics"].get("max_staleness_steps", 0)
        if worst > opts.modes.max_staleness_steps:
            return False, f"staleness reached {worst} local steps > bound {opts.modes.max_staleness_steps}"
        return True, ""
    if not summary["samples_exactly_once"]:
        return False, "sample accounting failed"
    d = summary.get("reference_max_abs_diff")
    if mode is ConsistencyMode.STRICT and opts.reference and (d is None or d > STRICT_TOLERANCE):
        return False, ("no final parameters to compare" if d is None
                       else f"parameters differ from the reference by {d:.2e} > {STRICT_TOLERANCE:g}")
    return True, ""


def _supersede_after_checkpoint(run_dir: Path) -> None:
    """Steps committed after the newest checkpoint died with every worker: they are redone on
    resume, so their records move to metrics.superseded.jsonl and the accounting counts each once."""
    from phalanx.checkpoint.durable import latest_checkpoint

    found = latest_checkpoint(run_dir)
    path = run_dir / "metrics.jsonl"
    if found is None or not path.exists():
        return
    tmp = path.with_suffix(".tmp")
    with open(path) as src, open(tmp, "w") as keep, open(run_dir / "metrics.superseded.jsonl", "a") as gone:
        for line in src:  # streamed: a long run's metrics are not read into memory
            if line.strip():
                (keep if json.loads(line)["step"] <= found[1] else gone).write(line.rstrip("\n") + "\n")
    os.replace(tmp, path)


def summarise(opts: TrainOptions, res: LaunchResult) -> dict[str, Any]:
    # (step, covered) per commit, streamed from the commit log (or, resumed, from every launch's metrics)
    commits = _all_commits(opts.run_dir) if opts.resume else [(c.step, c.covered_once) for c in res.commits]
    local = opts.modes.mode is ConsistencyMode.LOCAL_SGD
    return {
        "ok": res.ok,
        "reason": res.reason,
        "mode": opts.modes.mode.value,
        "workers": opts.workers,
        "steps": opts.steps,
        "steps_committed": len(commits),
        "steps_retried": res.steps_retried,
        "faults": res.faults,
        # local-sgd merges carry parameters, not global batches: exactly-once is not its guarantee
        "samples_exactly_once": None if local else samples_exactly_once(commits, opts),
        "final_loss": res.commits[-1].loss if res.commits else None,
        "launch_wall_s": round(res.wall_s, 3),
        "control_plane": res.transport,
        "false_suspicions": false_suspicions(res),
    }


def _all_commits(run_dir: Path) -> list[tuple[int, bool]]:
    with open(run_dir / "metrics.jsonl") as f:
        return [(c["step"], c["samples_covered_once"]) for c in (json.loads(x) for x in f if x.strip())]


def samples_exactly_once(commits: list[tuple[int, bool]], opts: TrainOptions) -> bool:
    """The exactly-once tally (train/sharding.py) over this run's (step, covered) commits and dataset."""
    from phalanx.workload.charlm_train import build

    _, data = build(seed=opts.seed, global_batch_size=opts.global_batch_size)
    return sharding.samples_exactly_once(commits, opts.steps, len(data), opts.global_batch_size, opts.seed)


def false_suspicions(res: LaunchResult) -> int:
    """Suspicions of workers that no fault targeted (a fault-free run must have none)."""
    targeted = {f"w{f['worker']}" for f in res.faults if f.get("worker") is not None}
    return sum(1 for e in res.events if e.get("event") == "worker_suspected" and e.get("worker") not in targeted)


def compare_with_reference(opts: TrainOptions) -> tuple[dict[str, Any], Any]:
    import torch

    from phalanx.checkpoint.durable import read_tensors_file
    from phalanx.workload.charlm_train import build
    from phalanx.workload.reference import max_abs_diff, train_reference

    torch.set_num_threads(1)
    cfg, data = build(seed=opts.seed, global_batch_size=opts.global_batch_size)
    ref = train_reference(cfg, data, opts.steps, opts.seed)
    finals = sorted(opts.run_dir.glob("final_*.safetensors"))
    diffs = {p.stem.removeprefix("final_"): max_abs_diff(read_tensors_file(p), ref.params) for p in finals}
    return {
        "reference_max_abs_diff": max(diffs.values()) if diffs else None,
        "reference_max_abs_diff_per_worker": diffs,
        "reference_final_loss": ref.final_loss,
        "reference_wall_s": round(ref.wall_s, 3),
    }, ref
