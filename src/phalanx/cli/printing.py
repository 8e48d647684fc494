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
        ("steps committed", str(s.get("steps_committed"))),
        ("steps retried", str(s.get("steps_retried"))),
        ("samples exactly once", str(s.get("samples_exactly_once"))),
        ("max |params - reference|", _f(s.get("reference_max_abs_diff"), "{:.2e}")),
        ("final loss / reference", f"{_f(s.get('final_loss'))} / {_f(s.get('reference_final_loss'))}"),
        ("false suspicions", str(s.get("false_suspicions"))),
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


def _f(x: Any, fmt: str = "{:.4f}") -> str:
    return "-" if x is None else fmt.format(x)
