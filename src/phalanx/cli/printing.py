"""Human-readable output of run summaries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def print_summary(s: dict[str, Any], run_dir: Path) -> None:
    con = Console()
    t = Table(title=f"phalanx train: {run_dir}", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value")
    rows = [
        ("result", "OK" if s.get("ok") else f"FAILED ({s.get('reason', '')})"),
        ("mode", str(s.get("mode", "strict"))),
        ("merges committed" if s.get("mode") == "local-sgd" else "steps committed", str(s.get("steps_committed"))),
        ("steps retried", str(s.get("steps_retried"))),
        ("samples exactly once", str(s.get("samples_exactly_once"))),
        ("max |params - reference|", _f(s.get("reference_max_abs_diff"), "{:.2e}")),
        ("final loss / reference", f"{_f(s.get('final_loss'))} / {_f(s.get('reference_final_loss'))}"),
        ("false suspicions", str(s.get("false_suspicions"))),
        ("throughput", _f((s.get("mode_metrics") or {}).get("throughput_samples_per_s"), "{:.0f} samples/s")),
        ("wall time", _f(s.get("wall_s"), "{:.1f} s")),
    ]
    for k, v in rows:
        t.add_row(k, v)
    con.print(t)
    if s.get("faults"):
        ft = Table(title="faults")
        for col in ("fault", "at step", "detected after", "recovered after"):
            ft.add_column(col)
        for f in s["faults"]:
            ft.add_row(f["description"], str(f["at_step"]), _f(f["detected_after_s"], "{:.3f} s"),
                       _f(f["recovered_after_s"], "{:.3f} s"))
        con.print(ft)
    if (run_dir / "report.html").exists():
        con.print(f"report: {run_dir / 'report.html'}   trace (ui.perfetto.dev): {run_dir / 'trace.json'}")


def _f(x: Any, fmt: str = "{:.4f}") -> str:
    return "-" if x is None else fmt.format(x)


def print_mode_row(r: dict[str, Any]) -> None:
    Console().print(f"[bold]{r['run']}[/bold]: {'OK' if r['ok'] else 'FAILED ' + r['reason']}, "
                    f"{_f(r['throughput_samples_per_s'], '{:.0f}')} samples/s, wall {_f(r['wall_s'], '{:.1f} s')}")


def print_mode_table(rows: list[dict[str, Any]], run_dir: Path) -> None:
    from phalanx.runtime.compare_modes import COLUMNS

    t = Table(title=f"phalanx train --compare-modes: {run_dir}")
    for c in COLUMNS:
        t.add_column(c)
    for r in rows:
        t.add_row(r["run"] if r["run"] == "fault-free" else r["mode"], r["faults"],
                  _f(r["throughput_samples_per_s"], "{:.0f}"), _f(r["throughput_vs_fault_free"], "{:.0%}"),
                  _f(r["time_to_target_loss_s"], "{:.2f} s"), _f(r["final_eval_loss"]),
                  _f(r["stall_s"], "{:.2f} s"), _f(r["reference_max_abs_diff"], "{:.1e}"),
                  "yes" if r["ok"] else f"NO ({r['reason']})")
    Console().print(t)
    Console().print(f"table: {run_dir / 'compare_modes.md'}")
