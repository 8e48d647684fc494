"""``one-in-a-thousand``: 1,000 workers, one stops answering; and the tail of the slowest of N.

Part 1 runs in the simulator (phalanx's coordinator and 1,000 workers): one worker freezes, with
the failure detector (and every other deadline) on, then off. Part 2 is fan-out amplification: a
step waits for the slowest of N workers, so a delay that hits one worker in a thousand hits most
steps of a 1,000-worker job. It is measured on simulated clusters with long-tailed links, and drawn
as the p99 of the slowest of N from per-worker draws (a sampling model, labelled as such).
"""

from __future__ import annotations

import random
from typing import Any

from matplotlib.figure import Figure

from phalanx.lab.context import LabContext
from phalanx.lab.jobs import JobRun, run_sim
from phalanx.lab.outcome import Outcome, new_figure, png
from phalanx.lab.switches import ALL_ON, off
from phalanx.sim.network import LinkModel
from phalanx.sim.scenario import Scenario

QUESTION = ("In a job of 1,000 workers, one stops answering. What is the step time of the whole job with and "
            "without failure detection, and how does the tail of the step time grow with the cluster, since every "
            "step waits for the slowest of N?")
SLOW_PROBABILITY = 0.001  # one worker-step in a thousand
SLOW_FACTOR = 10.0


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def stop_answering(ctx: LabContext, workers: int) -> dict[str, Any]:
    freeze_s, steps = (3.0, 10) if ctx.quick else (10.0, 20)

    def faults(sc: Scenario) -> Scenario:
        return sc.freeze(workers // 2 - 83, for_s=freeze_s, at_step=4)

    out = {}
    for label, sw in (("detection ON", ALL_ON), ("detection OFF", off("deadlines"))):
        ctx.say(f"{workers} simulated workers, one frozen {freeze_s:g} s, {label} ...")
        job = run_sim(workers, steps, faults, seed=ctx.seed, sw=sw, deadline_s=600.0)
        iv = job.step_intervals_s()
        out[label] = {"ok": job.ok, "median_step_s": job.median_step_s(),
                      "longest_step_s": round(job.longest_stall_s(), 3),
                      "mean_step_s": round(sum(iv) / len(iv), 4) if iv else None,
                      "detected_after_s": job.faults[0].get("detected_after_s") if job.faults else None,
                      "wall_s": job.wall_s, "step_intervals_s": iv}
    return {"workers": workers, "freeze_s": freeze_s, "steps": steps, "runs": out}


def measured_tail(ctx: LabContext) -> list[dict[str, Any]]:
    sizes = (8, 32, 128) if ctx.quick else (8, 64, 256)
    steps = 30 if ctx.quick else 60
    link = LinkModel(latency_s=0.0005, jitter_s=0.0005, distribution="pareto")
    pts = []
    for n in sizes:
        ctx.say(f"{n} simulated workers on long-tailed links, {steps} steps ...")
        job: JobRun = run_sim(n, steps, None, seed=ctx.seed, link=link)
        iv = job.step_intervals_s()
        pts.append({"workers": n, "median_step_s": _percentile(iv, 0.5), "p99_step_s": _percentile(iv, 0.99)})
    return pts


MODEL_SIZES = (1, 3, 10, 30, 100, 300, 1000)


def slowest_of_n(seed: int, draws: int = 2000) -> list[dict[str, Any]]:
    """p99 of max over N per-worker step times, each worker-step 10x slow with probability 1/1000."""
    rng = random.Random(f"lab-slowest-of-n:{seed}")
    out = []
    for n in MODEL_SIZES:
        maxima = []
        for _ in range(draws):
            slow = any(rng.random() < SLOW_PROBABILITY for _ in range(n))
            maxima.append(SLOW_FACTOR if slow else 1.0 + 0.02 * rng.random())
        p_slow = 1 - (1 - SLOW_PROBABILITY) ** n
        out.append({"workers": n, "p99_of_slowest": _percentile(maxima, 0.99),
                    "median_of_slowest": _percentile(maxima, 0.5),
                    "share_of_steps_slow": round(sum(m == SLOW_FACTOR for m in maxima) / len(maxima), 4),
                    "share_predicted": round(p_slow, 4)})
    return out


def run(ctx: LabContext) -> Outcome:
    workers = 1000
    part1 = stop_answering(ctx, workers)
    tail = measured_tail(ctx)
    model = slowest_of_n(ctx.seed)
    on, of = part1["runs"]["detection ON"], part1["runs"]["detection OFF"]
    rows: list[list[Any]] = [[f"{workers} workers, one frozen, {k}", v["median_step_s"], v["mean_step_s"],
                              v["longest_step_s"]] for k, v in part1["runs"].items()]
    rows += [[f"{p['workers']} workers, long-tailed links (measured)", p["median_step_s"], None, p["p99_step_s"]]
             for p in tail]
    rows += [[f"slowest of {m['workers']} (model: 1/1000 worker-steps 10x)", m["median_of_slowest"], None,
              m["p99_of_slowest"]] for m in model if m["workers"] in (1, 10, 100, 1000)]
    held = bool(of["longest_step_s"] > 2 * on["longest_step_s"] and on["ok"]
                and model[-1]["p99_of_slowest"] == SLOW_FACTOR and model[0]["p99_of_slowest"] < SLOW_FACTOR
                and tail[-1]["p99_step_s"] and tail[0]["p99_step_s"] and tail[-1]["p99_step_s"] > tail[0]["p99_step_s"])
    m1000 = model[-1]
    para = (f"One of {workers} workers froze for {part1['freeze_s']:g} s. With detection it was dropped after "
            f"{on['detected_after_s']} s and the job's longest step was {on['longest_step_s']:.2f} s (mean "
            f"{on['mean_step_s']} s); without it all {workers - 1} healthy workers waited: longest step "
            f"{of['longest_step_s']:.2f} s (mean {of['mean_step_s']} s). Fan-out: on long-tailed links the p99 step "
            f"grew from {tail[0]['p99_step_s']:.3f} s at {tail[0]['workers']} workers to "
            f"{tail[-1]['p99_step_s']:.3f} s "
            f"at {tail[-1]['workers']}; and a delay that hits one worker-step in a thousand slowed "
            f"{m1000['share_of_steps_slow']:.0%} of the steps of a 1,000-worker job (1 - 0.999^N predicts "
            f"{m1000['share_predicted']:.0%}): its p99 is the slow case itself, {m1000['p99_of_slowest']:g}x.")
    return Outcome("one-in-a-thousand", QUESTION,
                   (f"Simulator: {workers} workers x {part1['steps']} steps, w{workers // 2 - 83} frozen "
                    f"{part1['freeze_s']:g} s at step 4; OFF = every deadline a day. Tail: simulated clusters of "
                    f"{', '.join(str(p['workers']) for p in tail)} workers on pareto links (0.5 ms + 0.5 ms tail); "
                    "model: per-worker draws, each worker-step 10x slow with probability 1/1000."),
                   ["case", "median step (s or x)", "mean step (s)", "longest / p99 step (s or x)"], rows, para,
                   "without detection the longest step is > 2x longer; the slowest of 1,000 has a p99 at the slow "
                   "case while one worker's does not; measured p99 grows with N", held,
                   {"stop_answering": part1, "measured_tail": tail, "slowest_of_n_model": model},
                   {"step_times.png": _plot_steps(part1), "slowest_of_n.png": _plot_tail(model, tail)})


def _plot_steps(part1: dict[str, Any]) -> bytes:
    fig, ax = new_figure()
    for label, r in part1["runs"].items():
        ax.plot(range(1, len(r["step_intervals_s"]) + 1), r["step_intervals_s"], marker="o", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (s)")
    ax.set_title(f"{part1['workers']} workers, one stops answering")
    ax.legend()
    return png(fig)


def _plot_tail(model: list[dict[str, Any]], tail: list[dict[str, Any]]) -> bytes:
    fig = Figure(figsize=(9.0, 3.6))
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.set_xscale("log")
        ax.set_xlabel("workers N")
    ns = [m["workers"] for m in model]
    left.plot(ns, [m["share_of_steps_slow"] for m in model], marker="o", label="measured in draws")
    left.plot(ns, [m["share_predicted"] for m in model], ls=":", color="#888", label="1 - 0.999^N")
    left.set_ylabel("share of steps slowed")
    left.set_title("one worker-step in 1,000 is 10x slow (model)", fontsize=9)
    left.legend(fontsize=8)
    tn = [p["workers"] for p in tail]
    right.plot(tn, [p["median_step_s"] for p in tail], marker="o", label="median")
    right.plot(tn, [p["p99_step_s"] for p in tail], marker="s", label="p99")
    right.set_xticks(tn, [str(n) for n in tn])
    right.minorticks_off()
    right.set_ylabel("step time (s)")
    fig.subplots_adjust(wspace=0.35)
    right.set_title("simulated clusters, long-tailed links", fontsize=9)
    right.legend(fontsize=8)
    return png(fig)
