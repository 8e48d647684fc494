"""``latency``: weak-scaling efficiency against the number of workers as link latency grows, with
compute/communication overlap on and off.

The grid runs in the simulator (phalanx's coordinator and workers on simulated links whose
latency is both the control-plane delay and the all-reduce's per-message term), twice: with
``SimModelConfig.overlap`` (each of the gradient's buckets enters its all-reduce during the
compute, as a real backward's hooks start them) and without (all of them after the compute). One
real point checks the direction on real processes, also twice (``charlm_train`` with and without
``--no-overlap``): the same job with and without 5 ms added to every link, in alternate windows.
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
from phalanx.sim.workload import SimModelConfig

LATENCIES_MS = (0.0, 1.0, 5.0, 20.0)
STEP_COMPUTE_S = 0.05
GRADIENT_BYTES = 10_000_000  # a 2.5M-parameter fp32 model's gradients
GRAD_BUCKETS = 4  # the gradient travels in 4 buckets (then the small coverage tail), overlap on or off
GRID_DEADLINE_S = 120.0
DEFAULT_DEADLINE_S = 5.0  # CoordinatorConfig / Cluster default all-reduce deadline
REAL_MIN_STEP_S = 0.05  # the real point's paced compute, as the simulator's
REAL_LATENCY_MS = 5.0
WINDOW_S = 1.0  # the real point's latency is on for 1 s, off for 1 s, alternately
BUNDLED_GRADIENT_MB = 0.47  # the bundled char-LM: 116,576 fp32 parameters
MODES = {True: "overlap", False: "no overlap"}
QUESTION = ("How does the step time of data-parallel training scale with the number of workers as the link "
            "latency grows from 0 to 20 ms, with and without overlapping communication with compute: when does "
            "the network, not the compute, set the pace?")


def _sim_point(workers: int, latency_ms: float, steps: int, seed: int, overlap: bool) -> JobRun:
    lat_s = latency_ms / 1000
    link = LinkModel(latency_s=max(lat_s, 0.0), jitter_s=0.0, distribution="constant")
    coll = CollectiveModel(alpha_s=20e-6 + lat_s)
    # the all-reduce deadline is sized to the grid: at 64 workers x 20 ms one all-reduce outlasts the
    # default 5 s, and with it no step would ever commit (the paragraph says where that happens)
    return run_sim(workers, steps, None, seed=seed, link=link, collective=coll, step_compute_s=STEP_COMPUTE_S,
                   gradient_bytes=GRADIENT_BYTES, deadline_s=900.0, collective_timeout_s=GRID_DEADLINE_S,
                   model_cfg=SimModelConfig(grad_buckets=GRAD_BUCKETS, overlap=overlap))


def grid(ctx: LabContext) -> dict[str, Any]:
    sizes = (1, 2, 4, 8, 16) if ctx.quick else (1, 2, 4, 8, 16, 32, 64)
    steps = 12 if ctx.quick else 30
    base = _sim_point(1, 0.0, steps, ctx.seed, False).median_step_s() or STEP_COMPUTE_S
    cells = []
    for lat in LATENCIES_MS:
        ctx.say(f"simulating {', '.join(map(str, sizes))} workers at {lat:g} ms, overlap off and on ...")
        for n in sizes:
            cell: dict[str, Any] = {"latency_ms": lat, "workers": n}
            for overlap, mode in MODES.items():
                step = _sim_point(n, lat, steps, ctx.seed, overlap).median_step_s()
                cell[mode] = {"median_step_s": step, "efficiency": round(base / step, 4) if step else None}
            cells.append(cell)
    return {"single_worker_step_s": base, "sizes": list(sizes), "grad_buckets": GRAD_BUCKETS, "cells": cells}


def _windows_s(steps: int) -> list[float]:
    """Starts of the latency windows (at_s, from the first commit): on for WINDOW_S, off for
    WINDOW_S, alternately, over the time the job takes at its clean pace, so every window fires.
    Interleaving them makes the comparison fair on a shared machine: a burst of load from other
    jobs hits steps with and without the added latency alike, where a before/after split would
    charge it to one side."""
    span_s = steps * REAL_MIN_STEP_S  # the job lasts at least this long after its first commit
    return [0.5 + 2 * WINDOW_S * k for k in range(int((span_s - 0.5 - WINDOW_S) // (2 * WINDOW_S)) + 1)]


def split_intervals(commits_s: list[float], windows: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Step intervals (between successive commits) wholly inside a latency window, and wholly
    outside every window; intervals that straddle a window's edge are neither."""
    inside, outside = [], []
    for x, y in zip(commits_s, commits_s[1:]):
        if any(t0 <= x and y <= t1 for t0, t1 in windows):
            inside.append(y - x)
        elif not any(x < t1 and t0 < y for t0, t1 in windows):
            outside.append(y - x)
    return inside, outside


def _real_job(ctx: LabContext, overlap: bool, steps: int) -> dict[str, Any]:
    starts = _windows_s(steps)

    def faults(sc: Scenario) -> Scenario:
        for at_s in starts:
            sc = sc.latency(mean_ms=REAL_LATENCY_MS, at_s=at_s, for_s=WINDOW_S)
        return sc

    ctx.say(f"real point, {MODES[overlap]}: 2 worker processes, {REAL_LATENCY_MS:g} ms added to every link in "
            f"{len(starts)} windows of {WINDOW_S:g} s ...")
    job = run_real(ctx.sub(f"real-{REAL_LATENCY_MS:g}ms-{'overlap' if overlap else 'no-overlap'}"), 2, steps, faults,
                   seed=ctx.seed, min_step_s=REAL_MIN_STEP_S, max_wall_s=120.0, overlap=overlap)
    windows = [(t, t + WINDOW_S) for t in sorted(job.injected_at_s())]
    inside, outside = split_intervals(job.commit_times_s(), windows)
    clean, slow = _median(outside), _median(inside)
    return {"ok": job.ok, "reason": job.reason, "windows": len(windows), "intervals_clean": len(outside),
            "intervals_with_latency": len(inside), "median_step_clean_s": clean, "median_step_latency_s": slow,
            "slowdown": slow / clean if slow and clean else None}


def real_point(ctx: LabContext) -> dict[str, Any]:
    steps = 120 if ctx.quick else 240  # 3 (full: 6) latency windows
    return {MODES[ov]: _real_job(ctx, ov, steps) for ov in (True, False)}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _cell(g: dict[str, Any], lat: float, n: int) -> dict[str, Any]:
    return next(c for c in g["cells"] if c["latency_ms"] == lat and c["workers"] == n)


def _eff(g: dict[str, Any], lat: float, n: int, mode: str) -> float:
    return float(_cell(g, lat, n)[mode]["efficiency"] or 0.0)


def _gain_s(g: dict[str, Any], lat: float, n: int) -> float:
    """Step time overlap saved (no overlap minus overlap), measured."""
    c = _cell(g, lat, n)
    return float((c["no overlap"]["median_step_s"] or 0.0) - (c["overlap"]["median_step_s"] or 0.0))


def sim_claim(g: dict[str, Any]) -> bool:
    """Latency lowers efficiency with or without overlap (below 50% at 20 ms); overlap is never
    slower, lifts the 0 ms efficiency by >= 5 points, and at 20 ms saves at most the compute it
    can hide behind (a bucket cannot start before it is ready), a few percent of the step."""
    big = max(g["sizes"])
    falls = all(_eff(g, 20.0, big, m) < _eff(g, 0.0, big, m) and _eff(g, 20.0, big, m) < 0.5 for m in MODES.values())
    never_slower = all(_gain_s(g, c["latency_ms"], c["workers"]) >= -1e-3 for c in g["cells"])
    helps_at_0 = _eff(g, 0.0, big, "overlap") >= _eff(g, 0.0, big, "no overlap") + 0.05
    bounded_at_20 = _gain_s(g, 20.0, big) <= STEP_COMPUTE_S + 1e-3
    return falls and never_slower and helps_at_0 and bounded_at_20


def _sim_paragraph(g: dict[str, Any]) -> str:
    big = max(g["sizes"])
    step0, step20 = (_cell(g, lat, big)["no overlap"]["median_step_s"] or 1.0 for lat in (0.0, 20.0))
    return (f"One worker steps in {g['single_worker_step_s']:.3f} s. At {big} workers without overlap the efficiency "
            "was " + ", ".join(f"{_eff(g, lat, big, 'no overlap'):.0%} at {lat:g} ms" for lat in LATENCIES_MS)
            + "; with overlap (each of the gradient's " + f"{GRAD_BUCKETS} buckets enters its all-reduce as soon as "
            "the compute has produced it) " + ", ".join(f"{_eff(g, lat, big, 'overlap'):.0%}" for lat in LATENCIES_MS)
            + f". At 0 ms overlap saved {_gain_s(g, 0.0, big) * 1000:.1f} ms of a {step0:.3f} s step "
            f"({_gain_s(g, 0.0, big) / step0:.0%}): the buckets' communication is shorter than the compute and hides "
            f"behind it. At 20 ms it saved {_gain_s(g, 20.0, big) * 1000:.1f} ms of a {step20:.2f} s step "
            f"({_gain_s(g, 20.0, big) / step20:.1%}): a ring all-reduce pays the link latency 2(N-1) times per "
            "bucket, the communication outgrows the compute it could hide behind (overlap saves at most the "
            f"{STEP_COMPUTE_S:g} s of compute), and the network, not the compute, sets the pace."
            + _deadline_note(g["cells"]))


def _real_paragraph(g: dict[str, Any], real: dict[str, Any]) -> str:
    on, of = real["overlap"], real["no overlap"]
    if not (on["slowdown"] and of["slowdown"]):
        bad = on if not on["slowdown"] else of
        return f" The real point did not complete: {bad['reason']}."
    sim2 = {lat: _cell(g, lat, 2)["no overlap"]["median_step_s"] or 0.0 for lat in (0.0, REAL_LATENCY_MS)}
    return (f" Real point, 2 worker processes paced to {REAL_MIN_STEP_S:g} s of compute, {REAL_LATENCY_MS:g} ms "
            f"added to every link in alternate {WINDOW_S:g} s windows: with overlap the median step was "
            f"{on['median_step_clean_s']:.3f} s without the added latency and {on['median_step_latency_s']:.3f} s with "
            f"it ({on['slowdown']:.2f}x), without overlap {of['median_step_clean_s']:.3f} s and "
            f"{of['median_step_latency_s']:.3f} s ({of['slowdown']:.2f}x); the simulator's 2-worker ratio without "
            f"overlap was {sim2[REAL_LATENCY_MS] / (sim2[0.0] or 1):.2f}x. On real processes a latency fault's delay "
            "starts when a bucket's all-reduce starts (collectives/faulty.py), but the bundled model's gradients "
            "are one bucket, ready only when backward ends, so there is no compute left to hide it behind. "
            + _loopback_note(on, of))


def _loopback_note(on: dict[str, Any], of: dict[str, Any]) -> str:
    """Without the added latency, on loopback: overlap on against off, across two jobs."""
    b_on, b_off = on["median_step_clean_s"], of["median_step_clean_s"]
    why = (f"the bundled model's gradients ({BUNDLED_GRADIENT_MB} MB) are one bucket, whose all-reduce on loopback "
           "is short, so overlap has little to hide there; the simulator's 10 MB case is where overlap pays")
    if abs(b_off - b_on) < 0.05 * b_off:
        return (f"Without the added latency, on loopback, the two jobs' steps were within 5% of each other "
                f"({b_on:.3f} s with overlap, {b_off:.3f} s without): {why}.")
    return (f"Without the added latency the two jobs' steps differed ({b_on:.3f} s with overlap, {b_off:.3f} s "
            "without), but they ran one after the other on a machine shared with other jobs, whose load moves a "
            f"job's step by more than overlap could change it here ({why}); the ratios within each job, where the "
            "windows interleave with and without latency, are the figures to compare.")


def run(ctx: LabContext) -> Outcome:
    g = grid(ctx)
    real = None if ctx.sim else real_point(ctx)
    rows = [[c["latency_ms"], c["workers"], c["no overlap"]["median_step_s"], c["no overlap"]["efficiency"],
             c["overlap"]["median_step_s"], c["overlap"]["efficiency"]] for c in g["cells"]]
    para = _sim_paragraph(g) + ("" if real is None else _real_paragraph(g, real))
    held = sim_claim(g) and (real is None or all(bool(r["slowdown"] and r["slowdown"] > 1.0) for r in real.values()))
    big = max(g["sizes"])
    return Outcome("latency", QUESTION,
                   f"Simulator: N in {g['sizes']} workers x link latency {LATENCIES_MS} ms, overlap off and on, "
                   f"{STEP_COMPUTE_S} s of compute per worker per step (weak scaling), "
                   f"{GRADIENT_BYTES / 1e6:.0f} MB of gradients per step in {GRAD_BUCKETS} buckets, 10 Gbit/s links; "
                   "efficiency = one worker's step / N workers' step."
                   + ("" if real is None else f" Real: 2 local worker processes paced to {REAL_MIN_STEP_S:g} s per "
                      f"step, a {REAL_LATENCY_MS:g} ms latency fault on every link for {WINDOW_S:g} s of every "
                      f"{2 * WINDOW_S:g} s (steps inside the windows against steps outside them), with overlap and "
                      "with --no-overlap."),
                   ["latency (ms)", "workers", "step, no overlap (s)", "efficiency, no overlap",
                    "step, overlap (s)", "efficiency, overlap"], rows, para,
                   f"at {big} workers efficiency falls with latency, below 50% at 20 ms, with and without overlap; "
                   "overlap is never slower, gains >= 5 points at 0 ms and at most the compute at 20 ms; the real "
                   "step slows when latency is added, with and without overlap", held,
                   {"grid": g, "real_point": real}, {"efficiency.png": _plot(g)})


def _deadline_note(cells: list[dict[str, Any]]) -> str:
    over = [c for c in cells if (c["no overlap"]["median_step_s"] or 0.0) > DEFAULT_DEADLINE_S]
    if not over:
        return ""
    worst = max(over, key=lambda c: c["no overlap"]["median_step_s"])
    return (f" {len(over)} cell(s) step slower than the default {DEFAULT_DEADLINE_S:g} s all-reduce deadline (worst: "
            f"{worst['workers']} workers at {worst['latency_ms']:g} ms, {worst['no overlap']['median_step_s']:.1f} s): "
            f"with the default every all-reduce there would time out and no step would commit, so the grid runs "
            f"with a {GRID_DEADLINE_S:g} s deadline. Deadlines must grow with N x latency.")


def _plot(g: dict[str, Any]) -> bytes:
    fig, ax = new_figure()
    for lat in LATENCIES_MS:
        cells = [c for c in g["cells"] if c["latency_ms"] == lat]
        color = None
        for mode, style in (("overlap", "-"), ("no overlap", "--")):
            pts = [(c["workers"], c[mode]["efficiency"]) for c in cells if c[mode]["efficiency"]]
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=style, marker="o" if style == "-" else "x",
                           color=color, label=f"{lat:g} ms, {mode}")[0]
            color = line.get_color()
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("workers")
    ax.set_ylabel("scaling efficiency")
    ax.set_title("efficiency vs workers by link latency (solid: overlap, dashed: no overlap; both measured)")
    ax.legend(title="link latency", fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return png(fig)
