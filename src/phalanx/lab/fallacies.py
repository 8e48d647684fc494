"""The fallacies about the network itself (reliable, zero latency, infinite bandwidth, zero
transport cost), one experiment each: the failure with phalanx's mechanism switched off (lab
switches only), and the same run with it on. The rest are in fallacies_cluster.py.

These run in the simulator, which runs phalanx's own coordinator and worker code and has the knob
each one needs (link latency, collective algorithm, gradient size) at sizes a laptop cannot run.
"""

from __future__ import annotations

from typing import Any

from phalanx.core.modes import ConsistencyMode, ModeConfig
from phalanx.lab.context import LabContext
from phalanx.lab.jobs import JobRun, run_real, run_sim
from phalanx.lab.outcome import Outcome, new_figure, png
from phalanx.lab.switches import ALL_ON, off
from phalanx.sim.network import LinkModel
from phalanx.sim.process_group import CollectiveModel
from phalanx.sim.scenario import Scenario


def _stall_s(job: JobRun) -> float:
    return job.longest_stall_s()


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def bar_plot(title: str, labels: list[str], values: list[float], ylabel: str, log: bool = False) -> bytes:
    fig, ax = new_figure(6.5, 3.4)
    ax.bar(labels, values, color=["#e45756" if "OFF" in x else "#4c78a8" for x in labels])
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
    return png(fig)


# ---- 1. the network is reliable ----
def reliable_network(ctx: LabContext) -> Outcome:
    """Simulator by default; --real: 3 worker processes, the partition at the transport and
    process-group seams, and the launcher's wall-clock limit as the lab's deadline."""
    workers, part_s = (6, 6.0 if ctx.quick else 15.0) if ctx.sim else (3, 4.0)
    steps = int((1.0 + part_s + 3.0) / 0.05)

    def faults(sc: Scenario) -> Scenario:
        return sc.isolate(1, for_s=part_s, at_s=1.0)

    res: dict[str, JobRun] = {}
    for label, sw in (("deadlines ON", ALL_ON), ("deadlines OFF", off("deadlines"))):
        ctx.say(f"w1 cut off for {part_s:.0f} s, {label} ...")
        if ctx.sim:
            res[label] = run_sim(workers, steps, faults, seed=ctx.seed, sw=sw, deadline_s=120.0)
        else:
            res[label] = run_real(ctx.sub(label.split()[1].lower()), workers, steps, faults, seed=ctx.seed, sw=sw,
                                  min_step_s=0.05, max_wall_s=45.0, stall_timeout_s=60.0)
    rows, data = [], {}
    for label, job in res.items():
        t0 = job.injected_at_s()[0]
        during = sum(1 for t in job.commit_times_s() if t0 <= t < t0 + part_s)
        data[label] = {"commits_during_partition": during, "longest_stall_s": round(_stall_s(job), 3),
                       "ok": job.ok, "reason": job.reason, "detected_after_s": job.faults[0].get("detected_after_s"),
                       "last_commit_s": job.last_commit_s(), "ended_s": job.end_s(), "injected_s": t0}
        rows.append([label, during, round(_stall_s(job), 3), job.faults[0].get("detected_after_s"), job.ok])
    on, of = data["deadlines ON"], data["deadlines OFF"]
    held = on["commits_during_partition"] > 0 and of["commits_during_partition"] == 0
    para = (f"With deadlines, the cut-off worker was suspected after {_s(on['detected_after_s'])} and the other "
            f"{workers - 1} committed {on['commits_during_partition']} steps during the {part_s:.0f} s partition "
            f"(longest stall {on['longest_stall_s']:.2f} s). Without them nobody is ever declared dead: "
            f"{of['commits_during_partition']} steps committed during the partition and the job stalled "
            f"{of['longest_stall_s']:.2f} s: " + _after_partition(of, part_s))
    return Outcome("fallacy-reliable-network", "The network is reliable? What does a partition do to a job that "
                   "waits for every peer without a deadline?",
                   f"{workers} {'simulated workers' if ctx.sim else 'real worker processes'}, w1 isolated from "
                   f"everyone for {part_s:.0f} s{' (virtual)' if ctx.sim else ''}; "
                   "deadlines OFF = heartbeat, progress and collective timeouts of a day.",
                   ["run", "steps committed during partition", "longest stall (s)", "detected after (s)", "finished"],
                   rows, para, "deadlines on: steps commit during the partition; off: none do", held, data,
                   {"stall.png": bar_plot("longest stall through the partition", list(data),
                                       [d["longest_stall_s"] for d in data.values()], "s")})


def _after_partition(of: dict[str, Any], part_s: float) -> str:
    if of["ok"]:
        return "as long as the partition lasted."
    healed = of["ended_s"] is not None and of["injected_s"] is not None and of["ended_s"] > of["injected_s"] + part_s
    return ("it never committed again, even after the partition healed (the all-reduce that was in flight across "
            "it never completes and nothing gives up on it), until the lab's deadline ended the run "
            f"({of['reason']})." if healed else
            f"the run was stopped by its deadline while still waiting ({of['reason']}).")


# ---- 2. latency is zero ----
def zero_latency(ctx: LabContext) -> Outcome:
    workers, steps = 8, (60 if ctx.quick else 150)
    links = {"0.2 ms link": LinkModel(), "20 ms link": LinkModel(latency_s=0.02, jitter_s=0.02, distribution="pareto")}
    rows, data = [], {}
    for link_name, link in links.items():
        for label, sw in (("margin ON", ALL_ON), ("margin OFF", off("timeout_margin"))):
            ctx.say(f"{link_name}, heartbeat timeout {label} ...")
            job = run_sim(workers, steps, None, seed=ctx.seed, sw=sw, link=link, deadline_s=300.0)
            d = {"false_suspicions": job.false_suspicions(), "steps_rolled_back": job.summary.get("steps_retried", 0),
                 "median_step_s": job.median_step_s(), "goodput": job.summary.get("goodput_steps_per_virtual_s"),
                 "ok": job.ok}
            data[f"{link_name}, {label}"] = d
            rows.append([link_name, label, d["false_suspicions"], d["steps_rolled_back"], d["median_step_s"],
                         d["goodput"]])
    a, b = data["20 ms link, margin OFF"], data["20 ms link, margin ON"]
    local = data["0.2 ms link, margin OFF"]
    held = (a["false_suspicions"] >= 10 * max(1, b["false_suspicions"]) and local["false_suspicions"] == 0)
    para = (f"A heartbeat timeout sized for a local link (the 0.1 s interval + 50 ms) worked on the 0.2 ms link "
            f"({local['false_suspicions']} false suspicions), and on a 20 ms link with a long tail it declared "
            f"healthy workers dead {a['false_suspicions']} times, rolled back {a['steps_rolled_back']} steps and "
            f"cut goodput to {a['goodput']} steps/s, against {b['goodput']} with phalanx's 0.6 s timeout "
            f"({b['false_suspicions']} false suspicions)."
            + (" Even 0.6 s is not safe against a long tail, only rarer: a timeout trades detection time for false "
               "suspicions." if b["false_suspicions"] else ""))
    return Outcome("fallacy-zero-latency", "Latency is zero? What happens when a deadline is set as if the remote "
                   "call were local?",
                   f"{workers} simulated workers, {steps} steps, no faults at all; link 0.2 ms or 20 ms (pareto "
                   "jitter 20 ms); margin OFF = heartbeat timeout of the interval + 50 ms (0.15 s) instead of 0.6 s.",
                   ["link", "timeout", "false suspicions", "steps rolled back", "median step (s)", "goodput (steps/s)"],
                   rows, para,
                   "on the 20 ms link the tight timeout has >= 10x the false suspicions of 0.6 s (and > 0); "
                   "on the 0.2 ms link it has none", held, data,
                   {"false_suspicions.png": bar_plot("false suspicions (no fault was injected)", list(data),
                                                  [float(d["false_suspicions"]) for d in data.values()], "count")})


# ---- 3. bandwidth is infinite ----
def infinite_bandwidth(ctx: LabContext) -> Outcome:
    workers, steps, gbytes = 16, 8, 1.4e9  # 700M parameters in fp16 over 10 Gbit/s links
    rows, data = [], {}
    for label, sw in (("ring all-reduce", ALL_ON), ("tree all-reduce OFF", off("bandwidth_optimal_allreduce"))):
        ctx.say(f"{label}, {gbytes / 1e9:.1f} GB of gradients per step ...")
        job = run_sim(workers, steps, None, seed=ctx.seed, sw=sw, gradient_bytes=int(gbytes), deadline_s=600.0,
                      collective_timeout_s=120.0)
        model = CollectiveModel("ring" if sw.bandwidth_optimal_allreduce else "tree")
        d = {"median_step_s": job.median_step_s(), "allreduce_model_s": model.allreduce_s(workers, int(gbytes)),
             "ok": job.ok}
        data[label] = d
        rows.append([label, d["allreduce_model_s"], d["median_step_s"], job.ok])
    r, t = data["ring all-reduce"], data["tree all-reduce OFF"]
    held = bool(r["median_step_s"] and t["median_step_s"] and t["median_step_s"] > 2 * r["median_step_s"])
    para = (f"Moving {gbytes / 1e9:.1f} GB of gradients among {workers} workers on 10 Gbit/s links is most of the "
            f"step: the ring all-reduce (each byte crosses each link about twice) gave a median step of "
            f"{r['median_step_s']:.2f} s for 0.05 s of compute; a tree that sends whole copies log2(p) times gave "
            f"{t['median_step_s']:.2f} s, {t['median_step_s'] / r['median_step_s']:.1f}x slower.")
    return Outcome("fallacy-infinite-bandwidth", "Bandwidth is infinite? What does the choice of collective cost "
                   "when gradients are gigabytes?",
                   f"{workers} simulated workers, {steps} steps, gradients charged as {gbytes / 1e9:.1f} GB "
                   "(sizes only), 10 Gbit/s links; OFF = tree all-reduce instead of the ring.",
                   ["collective", "all-reduce cost model (s)", "median step (s)", "finished"], rows, para,
                   "tree step > 2x ring step", held, data,
                   {"step.png": bar_plot("median step with 1.4 GB of gradients", list(data),
                                      [d["median_step_s"] or 0.0 for d in data.values()], "s")})


# ---- 7. transport cost is zero ----
def zero_transport_cost(ctx: LabContext) -> Outcome:
    workers, steps, gbytes = 8, (20 if ctx.quick else 60), 2.8e8  # 140M parameters, fp16
    rows, data = [], {}
    runs = (("local-sgd, merge every 10", ALL_ON, ModeConfig(mode=ConsistencyMode.LOCAL_SGD)),
            ("strict, all-reduce every step OFF", off("infrequent_sync"),
             ModeConfig(mode=ConsistencyMode.LOCAL_SGD)))  # the switch makes it strict
    for label, sw, modes in runs:
        ctx.say(f"{label}, {gbytes / 1e6:.0f} MB per all-reduce ...")
        job = run_sim(workers, steps, None, seed=ctx.seed, sw=sw, modes=modes, gradient_bytes=int(gbytes),
                      deadline_s=600.0)
        n = int(job.summary.get("collectives", 0))
        d = {"collectives": n, "gigabytes_reduced": round(n * gbytes / 1e9, 2), "virtual_s": job.summary["virtual_s"],
             "final_loss": job.summary.get("final_loss"), "ok": job.ok}
        data[label] = d
        rows.append([label, n, d["gigabytes_reduced"], d["virtual_s"], d["final_loss"]])
    ls, st = data[runs[0][0]], data[runs[1][0]]
    held = st["gigabytes_reduced"] > 3 * ls["gigabytes_reduced"] and st["virtual_s"] > ls["virtual_s"]
    para = (f"Every transfer costs time: an all-reduce of {gbytes / 1e6:.0f} MB every step moved "
            f"{st['gigabytes_reduced']} GB through {st['collectives']} collectives and took {st['virtual_s']:.2f} s "
            f"for {steps} steps; merging every 10 steps (local-sgd) moved {ls['gigabytes_reduced']} GB and took "
            f"{ls['virtual_s']:.2f} s, at the price of a different model (final loss {ls['final_loss']:.4f} vs "
            f"{st['final_loss']:.4f}).")
    return Outcome("fallacy-zero-transport-cost", "Transport cost is zero? What does synchronising every step cost?",
                   f"{workers} simulated workers, {steps} steps, all-reduces charged as {gbytes / 1e6:.0f} MB; "
                   "OFF = strict mode's all-reduce every step instead of local-sgd's merge every 10 local steps.",
                   ["run", "collectives", "GB reduced", "virtual time (s)", "final loss"], rows, para,
                   "every-step sync moves > 3x the bytes and takes longer", held, data,
                   {"bytes.png": bar_plot("gigabytes reduced", list(data),
                                       [d["gigabytes_reduced"] for d in data.values()], "GB")})


