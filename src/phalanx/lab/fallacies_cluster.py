"""The fallacies about who and what is on the network (secure, fixed topology, one
administrator, homogeneous), one experiment each, mechanism off and on. The network ones are in
fallacies.py; the helpers (bar_plot, _s) are shared from there.

Most run in the simulator, which runs phalanx's own coordinator and worker code and has the knob
each one needs (link latency, collective algorithm, gradient size). ``fixed_topology`` sets
``min_workers`` (the launcher's, or the simulator Cluster's) and runs on real processes, or in the
simulator under ``--sim``/``--quick``; ``secure_network`` and
``one_administrator`` are sandboxes built from the real transport and run-folder functions.
"""

from __future__ import annotations

from typing import Any

from phalanx.core.modes import ConsistencyMode, ModeConfig
from phalanx.lab.context import LabContext
from phalanx.lab.fallacies import bar_plot
from phalanx.lab.jobs import JobRun, run_real, run_sim
from phalanx.lab.outcome import Outcome, new_figure, png
from phalanx.lab.sandboxes import foreign_folder_trial, forged_frame_trial
from phalanx.lab.switches import ALL_ON, LabSwitches, off
from phalanx.sim.scenario import Scenario

FIXED_WORLD_DEADLINE_S = 25.0  # the fixed world never finishes once a worker is gone: the lab stops it here


# ---- 4. the network is secure ----
def secure_network(ctx: LabContext) -> Outcome:
    ctx.say("a forged StepDecision(commit=True) sent to a real TcpTransport listener ...")
    trials = {"authentication ON": forged_frame_trial(ALL_ON), "authentication OFF": forged_frame_trial(
        off("authentication"))}
    rows = [[k, v["handshake"], v["forged_accepted"], v["genuine_accepted"], v["rejections"]]
            for k, v in trials.items()]
    on, of = trials["authentication ON"], trials["authentication OFF"]
    held = of["forged_accepted"] == 1 and on["forged_accepted"] == 0 and on["genuine_accepted"] == 1
    para = (f"An attacker on the network who does not hold the cluster token sent StepDecision(commit=True). "
            f"With a per-run secret token the listener refused its handshake ({on['handshake']}; "
            f"{on['rejections']} rejection(s) counted) and accepted {on['forged_accepted']} forged messages, while "
            f"a genuine peer with the token got {on['genuine_accepted']} through. With authentication off (a public "
            f"key anyone can compute MACs with) the forged decision was delivered ({of['forged_accepted']}): "
            f"{of.get('delivered', '')}.")
    return Outcome("fallacy-secure-network", "The network is secure? What does a forged frame do with and without "
                   "frame authentication?",
                   "Sandbox on 127.0.0.1: phalanx's own TcpTransport listener and client (HMAC-SHA256 handshake and "
                   "frames); OFF = the cluster key is public (empty), so the attacker can compute valid MACs.",
                   ["run", "attacker's handshake", "forged frames accepted", "genuine frames accepted",
                    "rejections counted"], rows, para, "forged frame accepted with authentication off, refused on",
                   held, trials, {"forged.png": bar_plot("forged frames delivered to the victim", list(trials),
                                                         [float(v["forged_accepted"]) for v in trials.values()],
                                                         "frames")})


# ---- 5. topology doesn't change ----
def fixed_topology(ctx: LabContext) -> Outcome:
    workers, steps = 3, (40 if ctx.quick else 150)

    def faults(sc: Scenario) -> Scenario:
        return sc.crash(2, at_s=1.0, restart=False)

    rows, data, timelines = [], {}, {}
    for label, sw in (("elastic quorum", ALL_ON), ("fixed world OFF", off("elastic_membership"))):
        ctx.say(f"w2 leaves for good at 1 s, {label}, on {ctx.where} ...")
        # the fixed world stands still once w2 is gone: the lab's deadline (virtual or wall-clock) stops it
        deadline_s = 90.0 if sw.elastic_membership else FIXED_WORLD_DEADLINE_S
        if ctx.sim:  # the simulator's Cluster takes min_workers like the launcher
            job = run_sim(workers, steps, faults, seed=ctx.seed, sw=sw, deadline_s=deadline_s)
        else:
            job = run_real(ctx.sub(label.split()[0]), workers, steps, faults, seed=ctx.seed, sw=sw, min_step_s=0.05,
                           max_wall_s=deadline_s, stall_timeout_s=6.0)
        data[label] = {"ok": job.ok, "reason": job.reason, "steps_committed": job.steps_committed(),
                       "steps": steps}
        timelines[label] = job.commit_times_s()
        rows.append([label, f"{job.steps_committed()} / {steps}", job.steps_committed() == steps, job.reason or "-"])
    e, f = data["elastic quorum"], data["fixed world OFF"]
    held = e["steps_committed"] == steps and f["steps_committed"] < steps
    para = (f"w2 was SIGKILLed and not restarted. With phalanx's elastic quorum the remaining {workers - 1} workers "
            f"re-formed and committed {e['steps_committed']} of {steps} steps"
            + ("" if e["ok"] else f" (the run's own verdict was not ok: {e['reason']})")
            + f". With a fixed world (every step needs "
            f"all {workers} workers, like a static torchrun world) the job committed {f['steps_committed']} and then "
            f"stood still until the lab's deadline stopped it: {f['reason']}.")
    return Outcome("fallacy-fixed-topology", "Topology doesn't change? What happens when a member leaves for good?",
                   f"{workers} workers on {ctx.where}, {steps} steps; w2 SIGKILLed at 1 s, no restart; OFF = "
                   f"min_workers = {workers}, stopped by a {FIXED_WORLD_DEADLINE_S:.0f} s "
                   f"{'virtual' if ctx.sim else 'wall-clock'} deadline.",
                   ["run", "steps committed", "all steps committed", "how it ended"], rows, para,
                   "elastic: every step commits; fixed world: the job stops short", held, data,
                   {"commits.png": _commit_plot(timelines)})


def _commit_plot(timelines: dict[str, list[float]]) -> bytes:
    fig, ax = new_figure(6.5, 3.4)
    for label, times in timelines.items():
        t0 = times[0] if times else 0.0
        ax.step([t - t0 for t in times], range(1, len(times) + 1), where="post", label=label)
    ax.set_xlabel("time since the first commit (s)")
    ax.set_ylabel("steps committed")
    ax.set_title("a worker leaves for good at 1 s")
    ax.legend()
    return png(fig)


# ---- 6. there is one administrator ----
def one_administrator(ctx: LabContext) -> Outcome:
    ctx.say("someone else's folder passed as a run folder ...")
    trials = {"ownership check ON": foreign_folder_trial(ctx.out_dir / "sandbox" / "on", ALL_ON),
              "ownership check OFF": foreign_folder_trial(ctx.out_dir / "sandbox" / "off", off("run_dir_ownership"))}
    rows = [[k, v["files_before"], v["files_deleted"], v["refused"] or "-"] for k, v in trials.items()]
    on, of = trials["ownership check ON"], trials["ownership check OFF"]
    held = on["files_deleted"] == 0 and of["files_deleted"] > 0
    para = (f"Another person's folder held {on['files_before']} files, some named like phalanx outputs (their own "
            f"report.html, a checkpoints/ folder). With the ownership check phalanx refused it and deleted "
            f"{on['files_deleted']}: {on['refused']}. Without it, a fresh run's clean-up deleted "
            f"{of['files_deleted']} of their files.")
    return Outcome("fallacy-one-administrator", "There is one administrator? What if the folder a run is pointed at "
                   "belongs to somebody else?",
                   "Sandbox: runtime/run_dir.py's claim_run_dir and clear_run_outputs on a folder phalanx did not "
                   "create; OFF = the folder is adopted without checking for the .phalanx-run marker.",
                   ["run", "their files", "files deleted", "refusal"], rows, para,
                   "with the check: 0 files deleted; without: > 0", held, trials,
                   {"deleted.png": bar_plot("their files deleted", list(trials),
                                            [float(v["files_deleted"]) for v in trials.values()], "files")})


# ---- 8. the network is homogeneous ----
def homogeneous_network(ctx: LabContext) -> Outcome:
    workers, steps = 4, (40 if ctx.quick else 120)

    def faults(sc: Scenario) -> Scenario:
        return sc.straggle(0, factor=4.0, at_step=1)

    rows, data = [], {}
    runs = (("speed-sized shares", ALL_ON, ModeConfig(mode=ConsistencyMode.AVAILABLE)),
            ("equal shares OFF", off("adaptive_shares"),
             ModeConfig(mode=ConsistencyMode.AVAILABLE)))  # the switch makes it strict
    for label, sw, modes in runs:
        ctx.say(f"w0 4x slower, {label} on {ctx.where} ...")
        job = _hetero_job(ctx, label, workers, steps, faults, sw, modes)
        d = {"median_step_s": job.median_step_s(), "ok": job.ok, "steps_committed": job.steps_committed()}
        data[label] = d
        rows.append([label, d["median_step_s"], d["steps_committed"], job.ok])
    a, e = data["speed-sized shares"], data["equal shares OFF"]
    held = bool(a["median_step_s"] and e["median_step_s"] and e["median_step_s"] > 1.3 * a["median_step_s"])
    para = (f"One of {workers} workers computes 4x slower. With equal shares every step waits for it: median step "
            f"{e['median_step_s']:.3f} s. Sizing each worker's share by its measured speed (available mode) brought "
            f"it to {a['median_step_s']:.3f} s, {e['median_step_s'] / a['median_step_s']:.2f}x faster, every sample "
            "still used once.")
    return Outcome("fallacy-homogeneous-network", "The network (and the cluster) is homogeneous? What does one slow "
                   "worker do to equal shares?",
                   f"{workers} workers on {ctx.where}, {steps} steps, w0 4x slower from step 1; OFF = strict mode's "
                   "equal shares instead of available mode's speed-sized shares.",
                   ["run", "median step (s)", "steps committed", "finished"], rows, para,
                   "equal shares are > 1.3x slower per step than speed-sized shares", held, data,
                   {"step.png": bar_plot("median step with a 4x slower worker", list(data),
                                      [d["median_step_s"] or 0.0 for d in data.values()], "s")})


def _hetero_job(ctx: LabContext, label: str, workers: int, steps: int, faults: Any, sw: LabSwitches,
                modes: ModeConfig) -> JobRun:
    if ctx.sim:
        return run_sim(workers, steps, faults, seed=ctx.seed, sw=sw, modes=modes, step_compute_s=0.05)
    return run_real(ctx.sub(label.split()[0]), workers, steps, faults, seed=ctx.seed, sw=sw, modes=modes,
                    min_step_s=0.0, max_wall_s=120.0)
