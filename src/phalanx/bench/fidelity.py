"""Fidelity: the same scenario (4 workers, the bundled model, six kills and two freezes) for real
and in the simulator, with the simulator's compute and collective costs calibrated from a
fault-free real run and its OS-side costs (each kill's teardown, each restart's delay, a new
quorum's group build, a heal's load) from the fault run itself. Reports step, detection and
recovery times side by side (means over the faults of each kind: a single freeze's detection
depends on where it falls between heartbeats; the JSON keeps every fault's own times), and how
well a separate probe predicts the kills' teardown.

    python -m phalanx.bench fidelity [--steps 360] [--min-step-s 0.05] [--out runs/bench/fidelity.json]
                                     [--keep-runs DIR] [--no-group-build] [--teardown run|probe]

A second table says where each run's time went (steps of an unchanged quorum by world size, first
steps of a new quorum by the change), so a gap in the mean can be traced to the steps that carry it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from phalanx.bench.gloo_thread_watch import GlooThreadWatch
from phalanx.bench.kill_probe import probe_process_exit_s

# six kills (each worker restarts) and two 1.5 s freezes, 40 steps apart: one kill's detection is a
# few OS milliseconds, so a handful per side makes the mean comparable
_FAULTS = [("kill", 1), ("freeze", 2), ("kill", 3), ("kill", 0), ("freeze", 2), ("kill", 1), ("kill", 2), ("kill", 3)]
PLAN = "".join(f'[[fault]]\nkind = "{k}"\nworker = {w}\nat_step = {30 + 40 * i}\n'
               + ('restart = true\n' if k == "kill" else 'for_s = 1.5\n') for i, (k, w) in enumerate(_FAULTS))


def _run(steps: int, run_dir: Path, min_step_s: float, plan_text: str = "") -> Any:
    from phalanx.faults.plan import parse_fault_plan
    from phalanx.runtime.launcher import LaunchConfig, launch, python_argv

    plan = parse_fault_plan(plan_text, "<fidelity>") if plan_text else None
    argv = python_argv("phalanx.workload.charlm_train", "--steps", str(steps), "--min-step-s", str(min_step_s))
    res = launch(LaunchConfig(argv=argv, workers=4, run_dir=run_dir, restart_failed=True, total_steps=steps,
                              show_progress=False, **({"fault_plan": plan} if plan else {})))
    if not res.ok:
        raise RuntimeError(f"phalanx run failed: {res.reason}")
    return res


def _mean(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else None


def _field(c: Any, name: str) -> Any:
    return getattr(c, name) if hasattr(c, name) else c[name]


def _median_step(commits: list[Any], members: int | None = None) -> float | None:
    """Median step time after the first five, of steps committed by ``members`` workers (all)."""
    xs = [_field(c, "step_s") for c in commits[5:] if members is None or len(_field(c, "members")) == members]
    return statistics.median(xs) if xs else None


def _mean_step(commits: list[Any]) -> float:
    """Mean step time after the first five: fault gaps included (an aborted attempt's time goes
    to the step that then commits)."""
    return statistics.mean(_field(c, "step_s") for c in commits[5:])


def rejoin_delays_s(events: list[dict[str, Any]]) -> list[float]:
    """Each killed worker's time from its kill to its replacement joining the coordinator (the OS
    teardown, the launcher noticing, a fresh Python importing torch, the connect): what the
    simulator's ``restart_delay_s`` stands for, read from the real run's own events."""
    out = []
    for e in events:
        if e.get("event") == "fault_injected" and e.get("kind") == "kill":
            joined = next((j for j in events if j.get("event") == "worker_joined" and j.get("worker") == e["worker"]
                           and j["t"] > e["t"]), None)
            if joined is not None:
                out.append(joined["t"] - e["t"])
    return out


def kill_detection_parts_s(events: list[dict[str, Any]]) -> list[dict[str, float | None]]:
    """Each kill's detection split where the coordinator's events allow: from the fault's record
    (the SIGKILL follows at once) to the coordinator reading the killed worker's connection closed
    (``connection_lost``: the OS's teardown of the process, and the coordinator's loop getting to
    the socket), and from there to its ``worker_suspected`` (the protocol's part, which the simulator
    runs as is). The simulator charges the first as a teardown (``teardowns_s``) plus one control hop."""
    out: list[dict[str, float | None]] = []
    for i, e in enumerate(events):
        if e.get("event") != "fault_injected" or e.get("kind") != "kill":
            continue
        lost = suspected = None
        for f in events[i + 1:]:
            if f.get("worker") != e.get("worker"):
                continue
            if f.get("event") == "connection_lost" and lost is None:
                lost = f["t"] - e["t"]
            elif f.get("event") == "worker_suspected":
                suspected = f["t"] - e["t"]
                break
        out.append({"at_step": e.get("at_step"), "to_connection_lost_s": lost, "to_suspected_s": suspected})
    return out


def teardowns_s(parts: list[dict[str, float | None]], hop_s: float, fallback_s: float) -> list[float]:
    """Each real kill's OS teardown, in order, for the simulator's ``process_exits_s``: the time to
    the coordinator reading the connection closed, less the one control hop the simulator adds on
    top; a kill whose connection_lost the events lack takes ``fallback_s`` (the probe's)."""
    return [max(0.0, t - hop_s) if (t := p["to_connection_lost_s"]) is not None else fallback_s for p in parts]


def _span_records(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted((run_dir / "workers").glob("w*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "span" in rec:
                out.append(rec)
    return out


def group_build_gaps_s(commits: list[Any], spans: list[dict[str, Any]]) -> list[float]:
    """For the first step of each new quorum (its quorum id differs from the step before's): the
    time from the last member starting to build the quorum's Gloo group to the last member having
    it (each member's ``exchange_open`` span: from asking for the group, as its body starts to
    compute, to holding it). A real group forms only once every rank has arrived, so this is the
    build after the rendezvous: what ``CollectiveModel.group_build_s`` stands for (plus the two
    alphas of the store)."""
    by_step: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in spans:
        if r["span"] == "exchange_open":
            by_step.setdefault((r["step"], r.get("quorum_id", -1)), []).append(r)
    out = []
    for prev, c in zip(commits, commits[1:]):
        qid, step = _field(c, "quorum_id"), _field(c, "step")
        if qid == _field(prev, "quorum_id"):
            continue
        recs = {r["node"]: r for r in by_step.get((step, qid), [])}
        if recs and all(m in recs for m in _field(c, "members")):
            out.append(max(r["mono"] + r["dur"] for r in recs.values()) - max(r["mono"] for r in recs.values()))
    return out


def decision_spread_s(commits: list[Any], spans: list[dict[str, Any]]) -> dict[int, float]:
    """Median, by world size, over steps of an unchanged quorum after the first five, of how far
    apart the members' all-reduce spans end (each ends when that worker has the commit decision,
    sent to all at once): the fault-free run's few ms, against the fault run's (session 15: one
    member per quorum episode ~15 ms late, while a dead quorum's Gloo thread spun in its process)."""
    ends: dict[tuple[int, int], list[float]] = {}
    for r in spans:
        if r["span"] == "allreduce" and r.get("commit"):
            ends.setdefault((r["step"], r.get("quorum_id", -1)), []).append(r["mono"] + r["dur"])
    by_world: dict[int, list[float]] = {}
    for prev, c in zip(commits[4:], commits[5:]):
        n, e = len(_field(c, "members")), ends.get((_field(c, "step"), _field(c, "quorum_id")), [])
        if _field(c, "quorum_id") == _field(prev, "quorum_id") and n > 1 and len(e) == n:
            by_world.setdefault(n, []).append(max(e) - min(e))
    return {n: statistics.median(v) for n, v in sorted(by_world.items())}


def step_budget(commits: list[Any]) -> dict[str, dict[str, float]]:
    """Where a run's time went, step by step after the first five: steps of an unchanged quorum by
    world size, and first steps of a new quorum (a kill's abort, a rejoin's heal and group build) by
    the change in world size; count, total and mean of their step times (commit to commit)."""
    out: dict[str, dict[str, float]] = {}
    for i in range(5, len(commits)):
        c, prev = commits[i], commits[i - 1]
        n = len(_field(c, "members"))
        key = (f"{n} workers, same quorum" if _field(c, "quorum_id") == _field(prev, "quorum_id")
               else f"first step of a new quorum, {len(_field(prev, 'members'))} -> {n} workers")
        b = out.setdefault(key, {"steps": 0, "total_s": 0.0})
        b["steps"] += 1
        b["total_s"] += _field(c, "step_s")
    for b in out.values():
        b["mean_s"] = b["total_s"] / b["steps"]
    return dict(sorted(out.items()))


def _calibrate(compute_s: float, allreduce_s: float, calib_step: float, process_exit_s: float) -> dict[str, float]:
    """The simulator's costs from the fault-free run's spans, step by step as a fault-free step runs
    now (the fast path): the next quorum's grant rides on the commit decision, so a step is the
    compute span, the all-reduce span (the gradient's one bucket -- 0.47 MB, under the 25 MiB bucket
    size -- carrying the coverage tail, then the report -> decision round trip), and a gap of local
    work outside both spans (the optimizer step, the loop). The spans cannot tell the collective from
    the round trip, so the all-reduce span is split evenly: half for the one collective (a 4-rank
    ring, 2(n-1) alphas), half for the two one-way control hops. The gap is local work, so it is
    charged as compute. Plus the OS's process teardown after SIGKILL as a probe measures it (the
    prediction; each simulated kill is charged its real kill's own unless ``--teardown probe``)."""
    gap_s = max(0.0, calib_step - compute_s - allreduce_s)
    return {"gap_s": gap_s, "step_compute_s": compute_s + gap_s, "alpha_s": (allreduce_s / 2) / (2 * 3),
            "control_latency_s": max(0.0002, allreduce_s / 4), "process_exit_s": process_exit_s}


def _simulate(steps: int, c: dict[str, Any]) -> Any:
    from phalanx.faults.plan import parse_fault_plan
    from phalanx.sim.cluster import Cluster
    from phalanx.sim.network import LinkModel
    from phalanx.sim.process_group import CollectiveModel
    from phalanx.sim.workload import SimModelConfig

    return Cluster(workers=4, steps=steps, seed=1, plan=parse_fault_plan(PLAN, "<fidelity>"),
                   model_cfg=SimModelConfig(grad_buckets=1), step_compute_s=c["step_compute_s"], compute_jitter=0.05,
                   collective=CollectiveModel(alpha_s=c["alpha_s"], beta_s_per_byte=0.0,
                                              group_build_s=c.get("group_build_s", 0.0)),
                   link=LinkModel(latency_s=c["control_latency_s"], jitter_s=c["control_latency_s"] / 4),
                   process_exit_s=c["process_exit_s"], process_exits_s=tuple(c.get("process_exits_s", ())),
                   restart_delay_s=c["restart_delay_s"],
                   restart_delays_s=tuple(c.get("restart_delays_s", ())), heal_load_s=c.get("heal_load_s", 0.0)).run()


def _budget_table(budget: dict[str, dict[str, dict[str, float]]]) -> Table:
    bt = Table(title="where the time went: steps after the first five (count, total s, mean s)")
    for c in ("steps", "real", "simulated"):
        bt.add_column(c)
    for key in sorted(set(budget["real"]) | set(budget["simulated"])):
        bt.add_row(key, *(f"{b['steps']:.0f} / {b['total_s']:.3f} / {b['mean_s']:.4f}" if (b := budget[side].get(key))
                          else "-" for side in ("real", "simulated")))
    return bt


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=360)
    ap.add_argument("--min-step-s", type=float, default=0.05, help="paced compute, as in the fault tests")
    ap.add_argument("--out", default="runs/bench/fidelity.json")
    ap.add_argument("--no-group-build", dest="group_build", action="store_false",
                    help="simulate without the measured group build and heal load costs (as before session 15)")
    ap.add_argument("--teardown", choices=("run", "probe"), default="run",
                    help="each simulated kill's OS teardown: the fault run's own, kill by kill (as its restarts), "
                         "or the probe's median for all (before session 36)")
    ap.add_argument("--keep-runs", default="", help="keep the real runs' dirs (calib/, real/) under this folder")
    return ap.parse_args()


def _real_runs(args: argparse.Namespace, console: Console) -> tuple[Any, Any, list[Any], list[Any], list[Any]]:
    """The fault-free (calibration) run and the fault run, with all their workers' spans, and the
    fault run's Gloo threads' CPU per worker process."""
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(args.keep_runs or tmp_dir)
        console.print("real, fault-free (calibration) ...")
        calib = _run(args.steps, tmp / "calib", args.min_step_s)
        calib_spans = _span_records(tmp / "calib")
        console.print("real, kill + freeze ...")
        with GlooThreadWatch() as watch:
            real = _run(args.steps, tmp / "real", args.min_step_s, PLAN)
        return calib, real, calib_spans, _span_records(tmp / "real"), watch.summary()


def _calibration(args: argparse.Namespace, calib_step: float, compute_s: float, allreduce_s: float, real: Any,
                 real_spans: list[dict[str, Any]], parts: list[dict[str, float | None]]) -> tuple[dict[str, Any], list[float]]:
    """The simulator's costs: the fault-free run's step (``_calibrate``), the OS's teardown as a
    probe predicts it, and from the fault run itself each kill's teardown and each restart's delay
    (in order: the k-th kill's; ``parts``, its ``kill_detection_parts_s``), a new quorum's group
    build and the healed worker's state load."""
    calibration: dict[str, Any] = _calibrate(compute_s, allreduce_s, calib_step, probe_process_exit_s(args.min_step_s))
    # the simulator's default is 2 s; a real restart here takes what the run's events say
    rejoins = rejoin_delays_s(list(real.events))
    calibration["restart_delay_s"] = statistics.median(rejoins) if rejoins else 2.0
    calibration["restart_delays_s"] = rejoins
    # the OS's teardown of each killed process, from the same run (the probe's median predicts it: a row of its own)
    if args.teardown == "run":
        calibration["process_exits_s"] = teardowns_s(parts, calibration["control_latency_s"], calibration["process_exit_s"])
    # a new quorum's group build, from the same run's spans (the fault-free run builds one group,
    # at step 0, in its warm-up); the simulator's rendezvous already charges two alphas of it
    builds = group_build_gaps_s(list(real.commits), real_spans)
    calibration["group_build_measured_s"] = statistics.median(builds) if builds else 0.0
    calibration["group_build_s"] = (max(0.0, calibration["group_build_measured_s"] - 2 * calibration["alpha_s"])
                                    if args.group_build else 0.0)
    # a heal's span, real against simulated without a load cost: the difference is the real
    # worker's decoding and copying of the received state, which the simulator charges as heal_load_s
    heals = [r["dur"] for r in real_spans if r["span"] == "heal"]
    sim_heals = [r["dur"] for r in _simulate(args.steps, {**calibration, "heal_load_s": 0.0}).spans if r.get("span") == "heal"]
    calibration["heal_load_s"] = (max(0.0, statistics.median(heals) - statistics.median(sim_heals))
                                  if heals and sim_heals and args.group_build else 0.0)
    return calibration, builds


def main() -> int:
    args = _args()
    console = Console(stderr=True)
    calib, real, calib_spans, real_spans, gloo = _real_runs(args, console)
    compute_s = statistics.median(r["dur"] for r in calib_spans if r["span"] == "compute")
    allreduce_s = statistics.median(r["dur"] for r in calib_spans if r["span"] == "allreduce")
    spread = {"fault-free": decision_spread_s(list(calib.commits), calib_spans),
              "faults": decision_spread_s(list(real.commits), real_spans)}
    calib_step = _median_step(calib.commits)
    assert calib_step is not None, "the calibration run committed too few steps"
    parts = kill_detection_parts_s(list(real.events))
    calibration, builds = _calibration(args, calib_step, compute_s, allreduce_s, real, real_spans, parts)
    sim_result = _simulate(args.steps, calibration)
    sim = sim_result.summary
    # A run with six kills spends ~40 % of its steps with three workers (a restarted process takes
    # ~2 s to come back), so one median over all steps flips between the two populations: compare
    # each population's median, and the mean.
    sim_commits = sim_result.commits
    rows = [("median step, 4 workers (s)", _median_step(real.commits, 4), _median_step(sim_commits, 4)),
            ("median step, 3 workers (s)", _median_step(real.commits, 3), _median_step(sim_commits, 3)),
            ("mean step, faults included (s)", _mean_step(real.commits), _mean_step(sim_commits))]
    for kind in ("kill", "freeze"):
        rf = [f for f in real.faults if f["kind"] == kind]
        sf = [f for f in sim["faults"] if f["kind"] == kind]
        for what in ("detected", "recovered"):
            rows.append((f"{kind} x{len(rf)}: {'detection' if what == 'detected' else 'recovery'} (s, mean)",
                         _mean([f[f"{what}_after_s"] for f in rf]), _mean([f[f"{what}_after_s"] for f in sf])))
    # the OS's part alone, real against what the probe predicts (its median plus the control hop):
    # the kill rows above charge each kill its own (--teardown run) or the probe's (--teardown probe)
    rows.append((f"kill x{len(parts)}: to the connection's close, the probe's prediction (s, mean)",
                 _mean([p["to_connection_lost_s"] for p in parts]),
                 calibration["process_exit_s"] + calibration["control_latency_s"]))
    rows.append(("fault-free median step (s)", calib_step, None))
    t = Table(title="fidelity: real run vs calibrated simulation (4 workers, bundled model)")
    for c in ("measure", "real", "simulated", "sim / real"):
        t.add_column(c)
    table = []
    for name, r, s in rows:
        ratio = (s / r) if (r and s is not None) else None
        table.append({"measure": name, "real": r, "simulated": s, "ratio": ratio})
        t.add_row(name, f"{r:.4f}" if r is not None else "-", f"{s:.4f}" if s is not None else "-",
                  f"{ratio:.2f}" if ratio else "-")
    console.print(t)
    budget = {"real": step_budget(list(real.commits)), "simulated": step_budget(list(sim_commits))}
    console.print(_budget_table(budget))
    console.print("commit decision's spread over members (median, by world size, ms): " + "; ".join(
        f"{run} " + ", ".join(f"{n}: {1e3 * v:.1f}" for n, v in by.items()) for run, by in spread.items()))
    console.print("fault run, Gloo threads' CPU per worker process (s; busiest thread's peak share of a core): "
                  + ", ".join(f"{g['worker']}/{g['pid']} {g['gloo_cpu_s']:.2f} ({g['busiest_gloo_thread_peak_core']:.0%})"
                              for g in gloo))
    console.print("real kills, ms from the kill to the coordinator reading the connection closed / to suspecting "
                  f"the worker (probe's teardown: {1e3 * calibration['process_exit_s']:.1f}): " + ", ".join(
                      f"{1e3 * p['to_connection_lost_s']:.1f} / {1e3 * p['to_suspected_s']:.1f}" for p in parts
                      if p["to_connection_lost_s"] is not None and p["to_suspected_s"] is not None))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"calibration": {"compute_s": compute_s, "allreduce_s": allreduce_s, **calibration},
                               "rows": table, "step_budget": budget, "group_build_gaps_s": builds,
                               "decision_spread_s": spread, "gloo_threads": gloo,
                               "kill_detection_parts_s": parts,
                               "faults": {side: [{k: f.get(k) for k in ("kind", "worker", "at_step", "detected_after_s",
                                                                        "recovered_after_s")} for f in faults]
                                          for side, faults in (("real", real.faults), ("simulated", sim["faults"]))}},
                              indent=2))
    print(f"wrote {out}")
    return 0
