"""``latency``: weak-scaling efficiency against the number of workers as link latency grows.

The grid runs in the simulator (phalanx's coordinator and workers on simulated links whose
latency is both the control-plane delay and the all-reduce's per-message term); one real point
checks the direction on real processes: the same job before and after 5 ms is added to every link.
"""

from __future__ import annotations

import statistics
from typing import Any

from phalanx.lab.context import LabContext
from phalanx.lab.jobs import JobRun, run_real, run_sim
from phalanx.lab.outcome import Outcome, new_figure, png
from phalanx.sim.network import LinkModel
from phalanx.sim.process_group import CollectiveModel
from phalanx.sim.scenario import Scenario

LATENCIES_MS = (0.0, 1.0, 5.0, 20.0)
STEP_COMPUTE_S = 0.05
GRADIENT_BYTES = 10_000_000  # a 2.5M-parameter fp32 model's gradients
GRID_DEADLINE_S = 120.0
DEFAULT_DEADLINE_S = 5.0  # CoordinatorConfig / Cluster default all-reduce deadline
QUESTION = ("How does the step time of data-parallel training scale with the number of workers as the link "
            "latency grows from 0 to 20 ms: when does the network, not the compute, set the pace?")


def _sim_point(workers: int, latency_ms: float, steps: int, seed: int) -> JobRun:
    lat_s = latency_ms / 1000
    link = LinkModel(latency_s=max(lat_s, 0.0), jitter_s=0.0, distribution="constant")
    coll = CollectiveModel(alpha_s=20e-6 + lat_s)
    # the all-reduce deadline is sized to the grid: at 64 workers x 20 ms one all-reduce outlasts the
    # default 5 s, and with it no step would ever commit (the paragraph says where that happens)
    return run_sim(workers, steps, None, seed=seed, link=link, collective=coll, step_compute_s=STEP_COMPUTE_S,
                   gradient_bytes=GRADIENT_BYTES, deadline_s=900.0, collective_timeout_s=GRID_DEADLINE_S)


def grid(ctx: LabContext) -> dict[str, Any]:
    sizes = (1, 2, 4, 8, 16) if ctx.quick else (1, 2, 4, 8, 16, 32, 64)
    steps = 12 if ctx.quick else 30
    base = _sim_point(1, 0.0, steps, ctx.seed).median_step_s() or STEP_COMPUTE_S
    cells = []
    for lat in LATENCIES_MS:
        ctx.say(f"simulating {', '.join(map(str, sizes))} workers at {lat:g} ms ...")
        for n in sizes:
            step = _sim_point(n, lat, steps, ctx.seed).median_step_s()
            eff = base / step if step else None
            cells.append({"latency_ms": lat, "workers": n, "median_step_s": step,
                          "efficiency": None if eff is None else round(eff, 4),
                          # the best any compute/communication overlap could do: max(compute, communication)
                          "overlap_bound": None if step is None else round(base / max(base, step - base), 4)})
    return {"single_worker_step_s": base, "sizes": list(sizes), "cells": cells}


def real_point(ctx: LabContext) -> dict[str, Any]:
    steps, at_step = (40, 20) if ctx.quick else (80, 40)

    def faults(sc: Scenario) -> Scenario:
        return sc.latency(mean_ms=5.0, at_step=at_step)

    ctx.say("real point: 2 worker processes, 5 ms added to every link halfway ...")
    job = run_real(ctx.sub("real-5ms"), 2, steps, faults, seed=ctx.seed, max_wall_s=120.0)
    t = job.of("step_committed")
    inj = job.injected_at_s()
    t_inj = inj[0] if inj else float("inf")
    times = [float(e["t"]) for e in t]
    before = [b - a for a, b in zip(times, times[1:]) if b < t_inj]
    after = [b - a for a, b in zip(times, times[1:]) if a > t_inj]
    b, a = _median(before), _median(after)
    return {"ok": job.ok, "reason": job.reason, "median_step_before_s": b, "median_step_after_s": a,
            "slowdown": a / b if a and b else None}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def run(ctx: LabContext) -> Outcome:
    g = grid(ctx)
    real = None if ctx.sim else real_point(ctx)
    cells = g["cells"]
    rows = [[c["latency_ms"], c["workers"], c["median_step_s"], c["efficiency"], c["overlap_bound"]] for c in cells]
    big = max(g["sizes"])
    eff = {(c["latency_ms"], c["workers"]): c["efficiency"] or 0.0 for c in cells}
    sim2 = {lat: next(c["median_step_s"] for c in cells if c["latency_ms"] == lat and c["workers"] == 2)
            for lat in LATENCIES_MS}
    bound = next(c["overlap_bound"] or 0.0 for c in cells if c["latency_ms"] == 20.0 and c["workers"] == big)
    para = (f"One worker steps in {g['single_worker_step_s']:.3f} s. At {big} workers the efficiency was "
            + ", ".join(f"{eff[(lat, big)]:.0%} at {lat:g} ms" for lat in LATENCIES_MS)
            + ": a ring all-reduce pays the link latency 2(N-1) times per step, so at 20 ms the network, not the "
              "compute, sets the pace. Perfect overlap of compute and communication could at best reach "
            + f"{bound:.0%} there (a bound computed from the measured step, not a run: phalanx's step protocol "
              "starts the all-reduce after the backward pass)." + _deadline_note(cells))
    if real is not None:
        sim_ratio = (sim2[5.0] or 0) / (sim2[0.0] or 1)
        para += (f" Real point: 2 worker processes went from a median step of {real['median_step_before_s']:.3f} s to "
                 f"{real['median_step_after_s']:.3f} s when 5 ms was added to every link "
                 f"({real['slowdown']:.2f}x; the simulator's 2-worker ratio was {sim_ratio:.2f}x).") \
            if real["slowdown"] else f" Real point did not complete: {real['reason']}."
    held = eff[(20.0, big)] < eff[(0.0, big)] and eff[(20.0, big)] < 0.5 and (real is None or bool(
        real["slowdown"] and real["slowdown"] > 1.0))
    return Outcome("latency", QUESTION,
                   f"Simulator: N in {g['sizes']} workers x link latency {LATENCIES_MS} ms, {STEP_COMPUTE_S} s of "
                   f"compute per worker per step (weak scaling), {GRADIENT_BYTES / 1e6:.0f} MB of gradients per "
                   "all-reduce, 10 Gbit/s links; efficiency = one worker's step / N workers' step."
                   + ("" if real is None else " Real: 2 local worker processes, 5 ms latency fault from halfway."),
                   ["latency (ms)", "workers", "median step (s)", "efficiency", "perfect-overlap bound"], rows, para,
                   f"efficiency at {big} workers falls with latency, below 50% at 20 ms; the real step slows "
                   "when latency is added", held, {"grid": g, "real_point": real}, {"efficiency.png": _plot(g)})


def _deadline_note(cells: list[dict[str, Any]]) -> str:
    over = [c for c in cells if (c["median_step_s"] or 0.0) > DEFAULT_DEADLINE_S]
    if not over:
        return ""
    worst = max(over, key=lambda c: c["median_step_s"])
    return (f" {len(over)} cell(s) step slower than the default {DEFAULT_DEADLINE_S:g} s all-reduce deadline (worst: "
            f"{worst['workers']} workers at {worst['latency_ms']:g} ms, {worst['median_step_s']:.1f} s): with the "
            f"default every all-reduce there would time out and no step would commit, so the grid runs with a "
            f"{GRID_DEADLINE_S:g} s deadline. Deadlines must grow with N x latency.")


def _plot(g: dict[str, Any]) -> bytes:
    fig, ax = new_figure()
    for lat in LATENCIES_MS:
        pts = [(c["workers"], c["efficiency"]) for c in g["cells"] if c["latency_ms"] == lat and c["efficiency"]]
        line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{lat:g} ms")[0]
        bound = [(c["workers"], c["overlap_bound"]) for c in g["cells"]
                 if c["latency_ms"] == lat and c["overlap_bound"]]
        ax.plot([p[0] for p in bound], [p[1] for p in bound], ls=":", color=line.get_color(), lw=1)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("workers")
    ax.set_ylabel("scaling efficiency")
    ax.set_title("efficiency vs workers by link latency (dotted: perfect-overlap bound)")
    ax.legend(title="link latency")
    return png(fig)
