"""PNG plots for the run report, rendered off-screen.

The figures are built with ``matplotlib.figure.Figure`` on an explicit Agg canvas instead of through pyplot: pyplot
keeps global figure state and picks a GUI backend from the environment, and a report written on a headless training
box (or inside a test process) must do neither. The result is the same Agg rendering ``matplotlib.use("Agg")`` gives,
without changing the backend for whoever imported phalanx.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

Record = dict[str, Any]

# category -> the worker spans summed into it; the order is the stacking order of the bars
TIME_CATEGORIES: dict[str, tuple[str, ...]] = {
    "compute": ("compute",),
    # not exchange_open (a new quorum's group forming): it runs while the body computes, and what
    # the vote still waits for it is in the allreduce span
    "communicating": ("allreduce",),
    "waiting": ("quorum_wait",),
    "healing": ("heal", "heal_serve", "restore", "checkpoint"),
}
_CATEGORY_COLOURS = {"compute": "#4c78a8", "communicating": "#f58518", "waiting": "#bab0ac", "healing": "#e45756",
                     "other": "#72b7b2"}
_DPI = 96


@dataclass(frozen=True)
class FaultMark:
    """One injected fault on the run's time axis (coordinator seconds), as the step-time plot draws it."""

    label: str
    t_s: float
    ended_s: float | None = None  # when a timed fault (freeze, hang) was lifted; None for instantaneous faults
    detected_s: float | None = None


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, bbox_inches="tight")
    return buf.getvalue()


def _new(width_in: float = 8.0, height_in: float = 3.6) -> tuple[Figure, Any]:
    fig = Figure(figsize=(width_in, height_in))
    ax = fig.add_subplot(1, 1, 1)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} recorded", ha="center", va="center", transform=ax.transAxes, color="#888")


def _series(rows: list[Record], x_key: str, y_key: str) -> tuple[list[float], list[float]]:
    """The (x, y) pairs of rows where both keys are numbers, sorted by x."""
    pairs = sorted((float(r[x_key]), float(r[y_key])) for r in rows
                   if isinstance(r.get(x_key), (int, float)) and isinstance(r.get(y_key), (int, float)))
    return [p[0] for p in pairs], [p[1] for p in pairs]


def loss_png(runs: list[tuple[str, list[Record]]], reference: list[Record] | None = None) -> bytes:
    """Loss against step for one or more runs, with the fault-free reference dashed on top when there is one."""
    fig, ax = _new()
    drawn = False
    for label, metrics in runs:
        xs, ys = _series(metrics, "step", "loss")
        if xs:
            ax.plot(xs, ys, label=label, linewidth=1.4)
            drawn = True
    if reference:
        xs, ys = _series(reference, "step", "loss")
        if xs:
            ax.plot(xs, ys, "--", color="black", linewidth=1.0, label="reference (1 process, no faults)")
            drawn = True
    if not drawn:
        _no_data(ax, "loss")
    else:
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Training loss")
    return _png(fig)


def step_time_png(runs: list[tuple[str, list[Record]]], faults: list[FaultMark] | None = None) -> bytes:
    """Seconds per committed step against commit time; faults are shaded (timed) or marked (instant) and labelled.

    The first step includes start-up and a frozen worker can stretch one step to seconds, so when the slowest step is
    over ten times the typical one the y axis goes logarithmic: both the spike and the steady state stay readable.
    """
    fig, ax = _new(8.0, 3.8)
    all_ys: list[float] = []
    for label, metrics in runs:
        xs, ys = _series(metrics, "committed_at_s", "step_s")
        if xs:
            ax.plot(xs, ys, marker=".", markersize=3, linewidth=1.0, label=label)
            all_ys += ys
    if not all_ys:
        _no_data(ax, "committed steps")
    else:
        typical = sorted(all_ys)[len(all_ys) // 2]
        if typical > 0 and min(all_ys) > 0 and max(all_ys) > 10 * typical:
            ax.set_yscale("log")
    for mark in faults or []:
        _draw_fault(ax, mark)
    if len(runs) > 1 or faults:
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xlabel("time since coordinator start (s)")
    ax.set_ylabel("step time (s)")
    ax.set_title("Step time, with injected faults")
    return _png(fig)


def _draw_fault(ax: Any, mark: FaultMark) -> None:
    if mark.ended_s is not None and mark.ended_s > mark.t_s:
        ax.axvspan(mark.t_s, mark.ended_s, color="#e45756", alpha=0.18)
    ax.axvline(mark.t_s, color="#e45756", linewidth=1.2)
    if mark.detected_s is not None:
        ax.axvline(mark.detected_s, color="#e45756", linewidth=0.9, linestyle=":")
    ax.text(mark.t_s, 0.98, f" {mark.label}", transform=ax.get_xaxis_transform(), rotation=90, va="top",
            ha="right", fontsize=8, color="#b22222")


def time_breakdown(spans: list[Record]) -> dict[str, float]:
    """Seconds per category for one worker's spans; spans of unknown kinds are counted as "other"."""
    by_span = {span: cat for cat, names in TIME_CATEGORIES.items() for span in names}
    totals = {cat: 0.0 for cat in TIME_CATEGORIES}
    for r in spans:
        if isinstance(r.get("span"), str) and isinstance(r.get("dur"), (int, float)):
            cat = by_span.get(r["span"], "other")
            totals[cat] = totals.get(cat, 0.0) + float(r["dur"])
    return totals


def worker_time_png(breakdowns: dict[str, dict[str, float]]) -> bytes:
    """One stacked horizontal bar per worker: where its seconds went (compute, communicating, waiting, healing)."""
    names = sorted(breakdowns, key=lambda n: (len(n), n))
    fig, ax = _new(8.0, max(1.6, 0.55 * len(names) + 1.2))
    if not names:
        _no_data(ax, "worker spans")
    cats = list(TIME_CATEGORIES) + sorted({c for b in breakdowns.values() for c in b} - set(TIME_CATEGORIES))
    left = [0.0] * len(names)
    for cat in cats:
        widths = [breakdowns[n].get(cat, 0.0) for n in names]
        if names and any(widths):
            ax.barh(names, widths, left=left, color=_CATEGORY_COLOURS.get(cat, "#999"), label=cat)
            left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    if names:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.28), fontsize=8, ncol=len(cats), frameon=False)
    ax.set_xlabel("seconds")
    ax.set_title("Where each worker's time went")
    return _png(fig)
