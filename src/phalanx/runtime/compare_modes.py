"""``phalanx train --compare-modes``: the same workload and fault plan under every consistency mode.

Runs a fault-free strict baseline first (the "fault-free throughput" every ratio is against),
then strict, available and local-sgd through the fault plan, each in its own sub-folder, and
writes ``compare_modes.json`` and ``compare_modes.md`` (the table) in the parent folder.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from phalanx.core.modes import ConsistencyMode
from phalanx.runtime.train_job import TrainOptions, run_train

COLUMNS = ("mode", "faults", "throughput (samples/s)", "vs fault-free", "time to target loss", "final eval loss",
           "stall", "max |params - ref|", "guarantee held")


def compare_modes(opts: TrainOptions, modes: tuple[ConsistencyMode, ...] = tuple(ConsistencyMode),
                  on_row: Any = None) -> dict[str, Any]:
    parent = opts.run_dir
    parent.mkdir(parents=True, exist_ok=True)
    runs: list[tuple[str, TrainOptions]] = [
        ("fault-free", dataclasses.replace(opts, run_dir=parent / "fault-free", fault_plan=None,
                                           modes=dataclasses.replace(opts.modes, mode=ConsistencyMode.STRICT)))]
    for m in modes:
        runs.append((m.value, dataclasses.replace(opts, run_dir=parent / m.value,
                                                  modes=dataclasses.replace(opts.modes, mode=m))))
    rows = []
    base_tp = None
    for label, o in runs:
        s = run_train(o)
        mm = s.get("mode_metrics", {})
        tp = mm.get("throughput_samples_per_s")
        if label == "fault-free":
            base_tp = tp
        row = {
            "run": label, "mode": o.modes.mode.value, "faults": o.fault_plan.name if o.fault_plan else "none",
            "ok": s["ok"], "reason": s.get("reason", ""),
            "throughput_samples_per_s": tp,
            "throughput_vs_fault_free": round(tp / base_tp, 3) if tp and base_tp else None,
            "time_to_target_loss_s": mm.get("time_to_target_loss_s"), "target_loss": mm.get("target_loss"),
            "final_eval_loss": mm.get("final_eval_loss"), "reference_eval_loss": mm.get("reference_eval_loss"),
            "stall_s": mm.get("stall_s"), "reference_max_abs_diff": s.get("reference_max_abs_diff"),
            "samples_exactly_once": s.get("samples_exactly_once"), "max_staleness_steps": mm.get("max_staleness_steps"),
            "steps_retried": s.get("steps_retried"), "wall_s": s.get("wall_s"), "run_dir": str(o.run_dir),
        }
        rows.append(row)
        if on_row:
            on_row(row)
    result = {"workers": opts.workers, "steps": opts.steps, "fault_plan": opts.fault_plan.path if opts.fault_plan else None,
              "modes": dataclasses.asdict(opts.modes), "rows": rows}
    (parent / "compare_modes.json").write_text(json.dumps(result, indent=2, default=str))
    (parent / "compare_modes.md").write_text(markdown_table(rows))
    return result


def markdown_table(rows: list[dict[str, Any]]) -> str:
    def f(x: Any, fmt: str) -> str:
        return "-" if x is None else fmt.format(x)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        held = "yes" if r["ok"] else f"NO ({r['reason']})"
        lines.append("| " + " | ".join([
            r["run"] if r["run"] == "fault-free" else r["mode"], r["faults"],
            f(r["throughput_samples_per_s"], "{:.0f}"), f(r["throughput_vs_fault_free"], "{:.0%}"),
            f(r["time_to_target_loss_s"], "{:.2f} s"), f(r["final_eval_loss"], "{:.4f}"),
            f(r["stall_s"], "{:.2f} s"), f(r["reference_max_abs_diff"], "{:.1e}"), held]) + " |")
    return "\n".join(lines) + "\n"
