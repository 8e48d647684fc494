"""What one experiment hands back, and how it is shown: a rich table, a paragraph, report.html.

The paragraph is built by the experiment from this run's numbers; nothing here holds a figure.
"""

from __future__ import annotations

import base64
import html
import io
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from phalanx.runtime.run_dir import claim_run_dir


@dataclass
class Outcome:
    name: str
    question: str
    setup: str  # what ran: real processes or the simulator, sizes, faults, switches
    columns: list[str]
    rows: list[list[Any]]
    paragraph: str  # built from this run's numbers
    claim: str  # what the test checks, in words
    claim_held: bool
    data: dict[str, Any] = field(default_factory=dict)  # machine-readable results
    plots: dict[str, bytes] = field(default_factory=dict)  # file name -> PNG
    wall_s: float = 0.0


def new_figure(width_in: float = 7.5, height_in: float = 3.8) -> tuple[Figure, Any]:
    """An off-screen figure (no pyplot global state, no GUI backend), as obs/plots.py does."""
    fig = Figure(figsize=(width_in, height_in))
    ax = fig.add_subplot(1, 1, 1)
    ax.grid(True, alpha=0.3)
    return fig, ax


def png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    return buf.getvalue()


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != 0 and (abs(v) < 0.001 or abs(v) >= 1e5):
            return f"{v:.2e}"
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def default_dir(name: str) -> Path:
    return Path("runs/lab") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def write_outcome(o: Outcome, out_dir: Path) -> Path:
    """results.json, plots/*.png and a self-contained report.html in ``out_dir`` (a new or empty
    folder, or one phalanx created: never another's)."""
    claim_run_dir(out_dir)
    (out_dir / "plots").mkdir(exist_ok=True)
    for fname, data in o.plots.items():
        (out_dir / "plots" / fname).write_bytes(data)
    doc = {"experiment": o.name, "question": o.question, "setup": o.setup, "columns": o.columns, "rows": o.rows,
           "paragraph": o.paragraph, "claim": o.claim, "claim_held": o.claim_held, "wall_s": round(o.wall_s, 2),
           "plots": [f"plots/{f}" for f in o.plots], "data": o.data}
    (out_dir / "results.json").write_text(json.dumps(doc, indent=2, default=str))
    (out_dir / "report.html").write_text(_html(o))
    return out_dir


def _html(o: Outcome) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(c)}</th>" for c in o.columns)
    body = "".join("<tr>" + "".join(f"<td>{esc(fmt(v))}</td>" for v in r) + "</tr>" for r in o.rows)
    imgs = "".join(f'<figure><img alt="{esc(f)}" src="data:image/png;base64,{base64.b64encode(d).decode()}">'
                   f"<figcaption>{esc(f)}</figcaption></figure>" for f, d in o.plots.items())
    verdict = "held" if o.claim_held else "DID NOT HOLD"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>phalanx lab: {esc(o.name)}</title>"
            "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}img{max-width:100%}</style></head><body>"
            f"<h1>phalanx lab: {esc(o.name)}</h1><p><b>Question.</b> {esc(o.question)}</p>"
            f"<p><b>Setup.</b> {esc(o.setup)}</p><table><tr>{head}</tr>{body}</table>"
            f"<p><b>Measured.</b> {esc(o.paragraph)}</p><p><b>Claim</b> ({verdict}): {esc(o.claim)}</p>"
            f"{imgs}<p>Machine-readable: results.json. Wall time {o.wall_s:.1f} s.</p></body></html>")


def print_outcome(o: Outcome, out_dir: Path | None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    c = Console()
    t = Table(title=f"phalanx lab {o.name}", title_justify="left")
    for col in o.columns:
        t.add_column(col)
    for r in o.rows:
        t.add_row(*[escape(fmt(v)) for v in r])
    c.print(t)
    c.print(o.paragraph, markup=False, highlight=False)
    mark = "[green]held[/green]" if o.claim_held else "[red]DID NOT HOLD[/red]"
    c.print(f"claim {mark}: {escape(o.claim)}")
    if out_dir is not None:
        c.print(f"report: {escape(str(out_dir / 'report.html'))}  ({o.wall_s:.1f} s)")
