"""``partial-failure``: a crashed worker vs a frozen one vs a slow one vs a lossy link vs a hung
one that keeps heartbeating. One job goes through all five, spaced out; then the hang again with
the progress detector switched off, which hangs the job until its deadline."""

from __future__ import annotations

from typing import Any

from phalanx.lab.context import LabContext
from phalanx.lab.jobs import JobRun, run_real, run_sim
from phalanx.lab.outcome import Outcome, new_figure, png
from phalanx.lab.switches import off
from phalanx.sim.scenario import Scenario

NAME = "partial-failure"
QUESTION = ("Part of a cluster fails while the rest runs on. How long does phalanx take to notice each kind of "
            "partial failure, to get going again, and how much work is lost, and what happens to a worker that "
            "is hung but still heartbeating if the detector that watches progress is switched off?")
CASES = ("crash", "freeze", "slow", "lossy link", "hung, heartbeating")


def _schedule(gap_s: float, for_s: float) -> Any:
    def build(sc: Scenario) -> Scenario:
        return (sc.crash(1, at_s=0.5)
                  .freeze(2, for_s=for_s, at_s=0.5 + gap_s)
                  .straggle(0, factor=4.0, for_s=for_s, at_s=0.5 + 2 * gap_s)
                  .loss(probability=0.3, workers=[1], for_s=for_s, at_s=0.5 + 3 * gap_s)
                  .hang(2, for_s=for_s + 1.0, at_s=0.5 + 4 * gap_s))
    return build


def _hung(sc: Scenario) -> Scenario:
    return sc.hang(1, for_s=3600.0, at_s=0.5)


def _shape(ctx: LabContext) -> dict[str, Any]:
    if ctx.sim:
        return {"workers": 8, "gap_s": 4.0, "for_s": 2.0, "step_s": 0.05}
    if ctx.quick:
        return {"workers": 3, "gap_s": 4.0, "for_s": 1.5, "step_s": 0.1}
    return {"workers": 4, "gap_s": 6.0, "for_s": 2.5, "step_s": 0.1}


def _steps(shape: dict[str, Any]) -> int:
    """Enough steps that the job is still running a gap after the last fault."""
    return int((0.5 + 5 * shape["gap_s"] + 2.0) / shape["step_s"])


def _job(ctx: LabContext, name: str, shape: dict[str, Any], faults: Any, sw: Any = None,
         deadline_s: float = 120.0) -> JobRun:
    kw = {} if sw is None else {"sw": sw}
    if ctx.sim:
        return run_sim(shape["workers"], _steps(shape), faults, seed=ctx.seed, step_compute_s=shape["step_s"],
                       deadline_s=deadline_s, **kw)
    return run_real(ctx.sub(name), shape["workers"], _steps(shape), faults, seed=ctx.seed,
                    min_step_s=shape["step_s"], max_wall_s=deadline_s, stall_timeout_s=8.0, **kw)


def per_fault(job: JobRun) -> list[dict[str, Any]]:
    """Detection, recovery and work lost for each injected fault, over its window (until the next)."""
    starts = job.injected_at_s()
    end = job.last_commit_s() or (starts[-1] if starts else 0.0)
    median = job.median_step_s() or 0.0
    commits, aborts = job.commit_times_s(), [float(e["t"]) for e in job.of("step_aborted")]
    rows = []
    for i, rec in enumerate(job.faults):
        t0 = starts[i] if i < len(starts) else end
        t1 = starts[i + 1] if i + 1 < len(starts) else end
        n = sum(1 for t in commits if t0 <= t < t1)
        rows.append({"case": CASES[i] if i < len(CASES) else rec["kind"], "kind": rec["kind"],
                     "detected_after_s": rec.get("detected_after_s"), "recovered_after_s": rec.get("recovered_after_s"),
                     "steps_rolled_back": sum(1 for t in aborts if t0 <= t < t1),
                     "time_lost_s": round(max(0.0, (t1 - t0) - n * median), 3), "window_s": round(t1 - t0, 3)})
    return rows


def hang_outcome(job: JobRun) -> dict[str, Any]:
    starts = job.injected_at_s()
    t0 = starts[0] if starts else 0.0
    after = [t for t in job.commit_times_s() if t > t0]
    aborts = [float(e["t"]) for e in job.of("step_aborted") if float(e["t"]) > t0]
    return {"ok": job.ok, "reason": job.reason, "commits_after_hang": len(after),
            "first_commit_after_s": round(after[0] - t0, 3) if after else None, "steps_rolled_back": len(aborts),
            "time_lost_s": round(after[0] - t0 - (job.median_step_s() or 0.0), 3) if after else None,
            "detected": any(f.get("detected_after_s") is not None for f in job.faults),
            "hung": not job.ok and not after}


def run(ctx: LabContext) -> Outcome:
    shape = _shape(ctx)
    ctx.say(f"one job through five partial failures on {ctx.where} ...")
    main = _job(ctx, "five-faults", shape, _schedule(shape["gap_s"], shape["for_s"]))
    ctx.say("the hung worker again, progress detector OFF: the collective deadline is left ...")
    backstop = _job(ctx, "hang-no-progress-detector", shape, _hung, sw=off("progress_detector"),
                    deadline_s=30.0 if ctx.sim else 40.0)
    ctx.say("and with the collective deadline OFF too (bounded by the lab's deadline) ...")
    hung_job = _job(ctx, "hang-no-progress-watch-at-all", shape, _hung,
                    sw=off("progress_detector", "collective_deadline"), deadline_s=30.0 if ctx.sim else 40.0)
    rows = per_fault(main)
    hung, caught = hang_outcome(hung_job), hang_outcome(backstop)
    table = [[r["case"], r["detected_after_s"], r["recovered_after_s"], r["steps_rolled_back"], r["time_lost_s"]]
             for r in rows]
    table.append(["hung, progress detector OFF", None, caught["first_commit_after_s"], caught["steps_rolled_back"],
                  "hung" if caught["hung"] else caught["time_lost_s"]])
    table.append(["hung, + collective deadline OFF", None, None, hung["steps_rolled_back"],
                  "hung" if hung["hung"] else hung["time_lost_s"]])
    by = {r["case"]: r for r in rows}
    hang_detected = by.get("hung, heartbeating", {}).get("detected_after_s") is not None
    held = main.ok and hung["hung"] and not caught["hung"] and hang_detected
    return Outcome(
        name=NAME, question=QUESTION,
        setup=(f"{shape['workers']} workers on {ctx.where}, one job of {_steps(shape)} steps (paced to "
               f"{shape['step_s']} s) through: w1 SIGKILLed (restarted), w2 frozen {shape['for_s']} s, w0 4x slow "
               f"{shape['for_s']} s, 30% loss on w1's links {shape['for_s']} s, w2 hung {shape['for_s'] + 1} s while "
               f"heartbeating, {shape['gap_s']} s apart. Then w1 hung for good, with the progress detector off, "
               "and with the all-reduce deadline off as well."),
        columns=["failure", "detected after (s)", "recovered after (s)", "steps rolled back", "time lost (s)"],
        rows=table, paragraph=_paragraph(main, rows, hung, caught), claim_held=held,
        claim=("the job finishes through all five failures, the hung-but-heartbeating worker is detected by the "
               "progress detector; with it off the all-reduce deadline still catches it (later), and with both off "
               "the same hang stops the job: no step commits after it"),
        data={"shape": shape, "faults": rows, "job_ok": main.ok, "job_reason": main.reason,
              "median_step_s": main.median_step_s(), "hung_without_progress_watch": hung,
              "hung_without_progress_detector": caught,
              "false_suspicions": main.false_suspicions()},
        plots={"step_times.png": _plot(main)})


def _paragraph(main: JobRun, rows: list[dict[str, Any]], hung: dict[str, Any], caught: dict[str, Any]) -> str:
    def d(r: dict[str, Any]) -> str:
        x = r["detected_after_s"]
        return "never flagged" if x is None else f"flagged after {x:.2f} s"

    parts = [f"{r['case']}: {d(r)}, {r['steps_rolled_back']} step(s) rolled back, {r['time_lost_s']:.2f} s lost"
             for r in rows]
    med = main.median_step_s()
    tail = (f"With only the progress detector off, the all-reduce deadline was the backstop: the first step after "
            f"the hang committed {caught['first_commit_after_s']} s after it. "
            f"With the all-reduce deadline off as well, the hung worker kept heartbeating and "
            f"{hung['commits_after_hang']} step(s) committed after the hang; the job "
            f"{'hung until its deadline stopped it' if hung['hung'] else 'did not hang'}"
            f" ({hung['reason']}).")
    return (f"Median step {med:.3f} s; the job {'finished' if main.ok else 'FAILED: ' + main.reason}. "
            + "; ".join(parts) + ". A crash is the easy case (the connection drops); a slow worker is never a "
              "failure, it just sets the pace. " + tail)


def _plot(job: JobRun) -> bytes:
    fig, ax = new_figure()
    t = job.commit_times_s()
    iv = job.step_intervals_s()
    ax.plot(t[1:], iv, lw=1, color="#4c78a8")
    for ts, name in zip(job.injected_at_s(), CASES):
        ax.axvline(ts, color="#e45756", lw=0.8, ls="--")
        ax.text(ts, max(iv or [1]) * 0.95, name, rotation=90, va="top", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("time between commits (s)")
    ax.set_title("partial failures: step time through each fault")
    return png(fig)
