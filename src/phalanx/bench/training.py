"""Training benchmark: plain torch DDP (Gloo) vs phalanx strict and available, side by side in
one run with alternating repeats, on the bundled model and MLPs of ~6 M and ~25 M parameters, at
2 and 4 workers; then detection and recovery times for kill, freeze and GIL hang (each run
``--fault-repeats`` times, interleaved: the median and range are reported).

    python -m phalanx.bench training [--workloads charlm,mlp-6m,mlp-25m] [--workers 2,4]
                                     [--repeats 3] [--ddp-malloc tuned|both] [--ddp-sched tuned|both]
                                     [--fault-repeats 3] [--no-faults] [--ddp-again]
                                     [--out runs/bench/training.json]

Both sides run the same model, batches and optimizer, one thread per process. A step's time is the
cluster's: DDP's rank-0 loop (loop top to loop top; DDP's ranks move in lockstep) and phalanx's
commit-to-commit interval, median after a warm-up. Each repeat
runs the three systems back to back in a rotating order, so the machine's noise hits all of them;
a ratio is phalanx / DDP within one repeat, and every pair is reported. A second table gives the
CPU a step costs the whole job (every process and thread, the coordinator's launcher included;
``cpu_per_step``): where the step's ratio is above the CPU's, the rest is time the job's cores
waited on the step's critical path, not work. A third splits that CPU by thread: the workers'
training threads (the user's loop: forward, backward, optimizer, DDP's reducer hooks or phalanx's
hooks and wait), Gloo's threads, phalanx's control threads, the coordinator and the rest (each
worker reads its threads' CPU from /proc at the first measured step and the last: ``StepClock``).

Both sides' processes get the same glibc malloc thresholds (train/host_memory.py: ``job.track()``
sets them for phalanx's workers, the DDP worker sets the same) and the same heap pages (transparent
huge pages where the launcher gives its workers them), so the ratio is the protocols' cost.
``--ddp-malloc both`` adds plain DDP with glibc's own rule and pages ("ddp-glibc"), as a user runs
it: at 25 M parameters its optimizer's temporaries are mapped and faulted in again every step.

Their threads are scheduled alike too: DDP's process group is built on a thread marked
``SCHED_BATCH`` and its training thread gets nice +10, as ``phalanx.join()`` does for phalanx's
(runtime/worker_join.py). On a box with fewer cores than busy threads that makes DDP itself
faster, so "ddp" is the stricter peer. "ddp-os-sched" (on by default; ``--ddp-sched tuned`` leaves
it out) is DDP under the OS's default scheduling, as a user runs it, and the table gives phalanx's
ratio to it as well. ``--ddp-again`` runs "ddp" once more in every repeat (an A/A control): its
ratio to "ddp" is what the machine's noise alone does to a ratio, the floor under every other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from phalanx.bench.step_clock import THREAD_KINDS, WARMUP_STEPS
from phalanx.bench.workloads import WORKLOADS
from phalanx.core.modes import ConsistencyMode, ModeConfig
from phalanx.faults.plan import parse_fault_plan
from phalanx.runtime.launcher import LaunchConfig, launch, python_argv
from phalanx.train.host_memory import worker_hugepage_env

STEPS = {"charlm": 60, "mlp-6m": 40, "mlp-25m": 25}
SYSTEMS = ("ddp", "strict", "available")
# DDP's setups, (malloc, scheduling): "tuned" is as phalanx's workers have it, "default" as plain DDP runs
# "ddp-again" is "ddp" run once more (an A/A control, ``--ddp-again``): its ratio to "ddp" is what this
# machine's noise alone does to a ratio whose true value is 1
DDP_SETUPS = {"ddp": ("tuned", "tuned"), "ddp-glibc": ("default", "tuned"), "ddp-os-sched": ("tuned", "default"),
              "ddp-again": ("tuned", "tuned")}
PHALANX_SYSTEMS = ("strict", "available")
FAULTS = {
    "kill": '[[fault]]\nkind = "kill"\nworker = 1\nat_step = 30\nrestart = true\n',
    "freeze": '[[fault]]\nkind = "freeze"\nworker = 2\nat_step = 30\nfor_s = 3.0\n',
    "gil_hang": '[[fault]]\nkind = "gil_hang"\nworker = 3\nat_step = 30\nfor_s = 3.0\n',
}


def run_ddp(workers: int, steps: int, workload: str = "charlm", malloc: str = "tuned",
            sched: str = "tuned") -> tuple[list[float], float, float, dict[str, float]]:
    """Rank 0's step times, the CPU a step costs (every rank's, summed; ``cpu_per_step``), the
    part of it on the ranks' training threads, and all of it by thread kind (``cpu_by_thread``)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ddp.json"
        # "tuned": the environment phalanx's launcher gives its workers (the heap on huge pages)
        env = {**os.environ, **(worker_hugepage_env(os.environ)[0] if malloc == "tuned" else {})}
        procs = [subprocess.Popen([sys.executable, "-m", "phalanx.bench.ddp_worker", str(r), str(workers),
                                   str(store.port), str(steps), str(out), workload, malloc, sched], env=env)
                 for r in range(workers)]
        for p in procs:
            if p.wait(timeout=900) != 0:
                raise RuntimeError(f"DDP worker exited with {p.returncode}")
        cpu = [json.loads(Path(f"{out}.cpu{r}").read_text()) for r in range(workers)]
        return (json.loads(out.read_text())["step_s"], cpu_per_step([c["cpu_s"] for c in cpu]),
                cpu_per_step([c["thread_cpu_s"] for c in cpu]), cpu_by_thread([c.get("cpu_by_thread_s") for c in cpu]))


def cpu_per_step(per_worker: list[list[float]], launcher_s: float = 0.0) -> float:
    """The CPU seconds one step costs the whole job: each worker process's mean over its steps
    after the warm-up (every thread: training, control, Gloo's), summed, plus the launcher's
    (phalanx's coordinator) per commit. On a box with fewer cores than busy threads a step's time
    follows this; where it does not, the rest is waiting (cores idle on the step's critical path).

    A worker's last interval is left out, for DDP and phalanx alike: it ends after the loop has
    exited, so for phalanx it holds the job's end (the final checkpoint, written once by one worker:
    0.26 s of CPU for the 6 M MLP, which over 35 steps read as 7 ms a step), not a step."""
    means = [statistics.fmean(xs[WARMUP_STEPS:-1]) for xs in per_worker if len(xs) > WARMUP_STEPS + 1]
    return sum(means) + launcher_s


def cpu_by_thread(per_worker: list[dict[str, float] | None], coordinator_s: float = 0.0) -> dict[str, float]:
    """The CPU a step costs the whole job by kind of thread: each worker's (``StepClock``'s
    ``cpu_by_thread_s``: training, Gloo's, phalanx's control thread, other) summed, and the
    coordinator's (the launcher's per commit; 0 for DDP, which has none). {} when a worker could not
    read its threads (no ``/proc``): a partial sum would read as a cheaper job."""
    workers = [w for w in per_worker if w]
    if not per_worker or len(workers) < len(per_worker):
        return {}
    return {**{k: sum(w[k] for w in workers) for k in THREAD_KINDS}, "coordinator": coordinator_s}


class LauncherCpu:
    """This process's CPU per commit while it runs a job's coordinator (``launch`` runs it here):
    sampled every 0.1 s against the count of ``RUN/commits.jsonl``, from the warm-up's last commit
    to the sample that first saw the last commit (the job's end after it is not a step's cost)."""

    def __init__(self, run_dir: Path) -> None:
        self._log, self._stop = run_dir / "commits.jsonl", threading.Event()
        self._first: tuple[int, float] | None = None
        self._last: tuple[int, float] | None = None
        self._thread = threading.Thread(target=self._sample, name="bench-launcher-cpu", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        seen, offset = 0, 0
        while not self._stop.wait(0.1):
            try:
                with open(self._log, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                continue
            seen, offset = seen + chunk.count(b"\n"), offset + len(chunk)
            sample = (seen, time.process_time())
            if self._first is None and seen >= WARMUP_STEPS:
                self._first = sample
            elif self._last is None or seen > self._last[0]:
                self._last = sample

    def per_commit(self) -> float:
        self._stop.set()
        self._thread.join()
        if self._first is None or self._last is None or self._last[0] <= self._first[0]:
            return 0.0
        return (self._last[1] - self._first[1]) / (self._last[0] - self._first[0])


def run_phalanx(workers: int, steps: int, run_dir: Path, plan_text: str = "", workload: str = "",
                mode: str = "strict") -> Any:
    plan = parse_fault_plan(plan_text, "<bench>") if plan_text else None
    argv = (python_argv("phalanx.bench.phx_worker", str(steps), workload) if workload
            else python_argv("phalanx.workload.charlm_train", "--steps", str(steps)))
    cfg = LaunchConfig(argv=argv, workers=workers, run_dir=run_dir, restart_failed=True, total_steps=steps,
                       show_progress=False, modes=ModeConfig(mode=ConsistencyMode(mode)),
                       **({"fault_plan": plan} if plan else {}))
    res = launch(cfg)
    if not res.ok:
        raise RuntimeError(f"phalanx run failed: {res.reason}")
    return res


def _phalanx_step_s(workers: int, steps: int, run_dir: Path, workload: str,
                    mode: str) -> tuple[list[float], int, float, float, dict[str, float]]:
    """The cluster's step times (commit to commit, the coordinator's record: what DDP's rank-0 loop
    time is for DDP; a worker's own loop can skip steps in available mode when it falls behind and
    heals), the steps retried, the CPU a step costs (``cpu_per_step``) and the part of it on the
    workers' training threads, and all of it by thread kind (``cpu_by_thread``)."""
    launcher = LauncherCpu(run_dir)
    try:
        res = run_phalanx(workers, steps, run_dir, workload=workload, mode=mode)
    finally:
        launcher_s = launcher.per_commit()
    logs = [json.loads(f.read_text()) for f in sorted((run_dir / "workers").glob("*.steps.json"))]
    return ([c.step_s for c in res.commits], res.steps_retried, cpu_per_step([w.get("cpu_s", []) for w in logs], launcher_s),
            cpu_per_step([w.get("thread_cpu_s", []) for w in logs]),
            cpu_by_thread([w.get("cpu_by_thread_s") for w in logs], launcher_s))


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.2f}–{max(xs):.2f}" if len(xs) > 1 else f"{xs[0]:.2f}"


def _ratio_pairs(systems: tuple[str, ...]) -> list[tuple[str, str]]:
    """(system, peer) for every ratio the table shows: everyone against "ddp", and phalanx's
    modes against DDP under the OS's scheduling when that ran."""
    pairs = [(s, "ddp") for s in systems if s != "ddp"]
    if "ddp-os-sched" in systems:
        pairs += [(s, "ddp-os-sched") for s in systems if s in PHALANX_SYSTEMS]
    return pairs


def _ratio_key(system: str, peer: str) -> str:
    """The row's key prefix for ``system`` / ``peer``: ``strict``, ``strict_vs_ddp-os-sched``."""
    return system if peer == "ddp" else f"{system}_vs_{peer}"


def compare(workloads: list[str], worker_counts: list[int], repeats: int, con: Console, tmp: Path,
            on_row: Any = None, systems: tuple[str, ...] = SYSTEMS) -> list[dict[str, Any]]:
    rows = []
    total = len(workloads) * len(worker_counts) * repeats * len(systems)
    done = 0
    for name in workloads:
        for n in worker_counts:
            med: dict[str, list[float]] = {s: [] for s in systems}
            cpu: dict[str, list[float]] = {s: [] for s in systems}  # CPU seconds a step, all processes
            own: dict[str, list[float]] = {s: [] for s in systems}  # the part on the training threads
            kinds: dict[str, list[dict[str, float]]] = {s: [] for s in systems}  # all of it, by thread kind
            retries: dict[str, list[int]] = {s: [] for s in PHALANX_SYSTEMS}
            for r in range(repeats):
                k = r % len(systems)
                order = systems[k:] + systems[:k]  # rotate who goes first
                for system in order:
                    done += 1
                    con.print(f"[{done}/{total}] {name}, {n} workers, repeat {r + 1}: {system}")
                    steps = STEPS.get(name, 40)
                    if system in DDP_SETUPS:
                        step_s, cpu_s, own_s, by_kind = run_ddp(n, steps, name, *DDP_SETUPS[system])
                    else:
                        step_s, retried, cpu_s, own_s, by_kind = _phalanx_step_s(
                            n, steps, tmp / f"{name}-{n}-{system}-{r}", name, system)
                        retries[system].append(retried)
                    med[system].append(statistics.median(step_s[WARMUP_STEPS:]))
                    cpu[system].append(cpu_s)
                    own[system].append(own_s)
                    kinds[system].append(by_kind)
            row: dict[str, Any] = {"workload": name, "workers": n, "median_step_s": med, "cpu_per_step_s": cpu,
                                   "training_thread_cpu_per_step_s": own, "cpu_by_thread_per_step_s": kinds,
                                   "steps_retried": retries}
            for system, peer in _ratio_pairs(systems):
                key = _ratio_key(system, peer)
                for what, values in (("", med), ("cpu_", cpu)):
                    ratios = [p / d for p, d in zip(values[system], values[peer])]
                    row[f"{key}_{what}ratios"] = ratios
                    row[f"{key}_{what}ratio_median"] = statistics.median(ratios)
            rows.append(row)
            if on_row is not None:
                on_row(rows)
    return rows


def fault_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every run of one fault, with the median and range of its detection and recovery times (a
    run whose fault was never detected or recovered from counts as infinitely slow)."""
    out: dict[str, Any] = {"runs": runs}
    for k in ("detected_after_s", "recovered_after_s"):
        xs = [float(r[k]) if r.get(k) is not None else float("inf") for r in runs]
        out[k] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
    return out


def _ratio_table(rows: list[dict[str, Any]], systems: tuple[str, ...], title: str, values: str, prefix: str,
                 unit: str) -> None:
    """One table: each system's median of ``row[values]`` (seconds, shown in ms) and each ratio's
    median with its range (``row[key + "_" + prefix + "ratios"]``)."""
    pairs = _ratio_pairs(systems)
    t = Table(title=title)
    for col in ("workload", "workers", *(f"{s} {unit}" for s in systems), *(f"{s} / {p}" for s, p in pairs)):
        t.add_column(col, no_wrap=True)
    for row in rows:
        keys = [f"{_ratio_key(s, p)}_{prefix}" for s, p in pairs]
        t.add_row(row["workload"], str(row["workers"]),
                  *(f"{statistics.median(row[values][s]) * 1000:.1f}" for s in systems),
                  *(f"{row[k + 'ratio_median']:.2f} ({_spread(row[k + 'ratios'])})" for k in keys))
    Console(width=max(Console().width, 240)).print(t)


SPLIT_KINDS = (*THREAD_KINDS, "coordinator")  # cpu_by_thread's keys


def _split_table(rows: list[dict[str, Any]], systems: tuple[str, ...]) -> None:
    """Where each system's CPU a step goes, by thread: the workers' training threads (forward,
    backward, the optimizer; DDP's reducer hooks; phalanx's hooks and its wait for the collectives),
    Gloo's threads, phalanx's control threads (the step's messages, heartbeats, bookkeeping), the
    coordinator (the launcher's process) and the workers' other threads. Medians over the repeats
    (so they need not add up to the total exactly); "-" where a run could not read its threads."""
    t = Table(title="CPU a step by thread (ms, median over the repeats; all workers summed)")
    for col in ("workload", "workers", "system", *SPLIT_KINDS, "total"):
        t.add_column(col, no_wrap=True)
    for row in rows:
        for s in systems:
            runs = [k for k in row["cpu_by_thread_per_step_s"][s] if k]
            cells = [f"{statistics.median(k[kind] for k in runs) * 1000:.1f}" if runs else "-" for kind in SPLIT_KINDS]
            total = f"{statistics.median(sum(k.values()) for k in runs) * 1000:.1f}" if runs else "-"
            t.add_row(row["workload"], str(row["workers"]), s, *cells, total)
    Console(width=max(Console().width, 240)).print(t)


def _print_tables(rows: list[dict[str, Any]], systems: tuple[str, ...], faults: dict[str, Any]) -> None:
    """The step table, the CPU table and the faults' detection and recovery."""
    _ratio_table(rows, systems, "phalanx vs torch DDP (Gloo): median step, ratio per alternating pair",
                 "median_step_s", "", "ms")
    _ratio_table(rows, systems, "CPU a step costs the whole job (all processes, every thread): median, ratio per pair",
                 "cpu_per_step_s", "cpu_", "cpu ms")
    _split_table(rows, systems)
    if faults:
        ft = Table(title="detection and recovery (4 workers, bundled model): median (range)")
        ft.add_column("fault")
        ft.add_column("detected after")
        ft.add_column("recovered after")
        for kind, f in faults.items():
            ft.add_row(kind, *(f"{f[k]['median']:.3f} s ({f[k]['min']:.3f}-{f[k]['max']:.3f}, {len(f['runs'])} runs)"
                               for k in ("detected_after_s", "recovered_after_s")))
        Console().print(ft)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--workers", default="2,4", help="comma-separated worker counts")
    ap.add_argument("--repeats", type=int, default=3, help="alternating DDP/strict/available rounds")
    ap.add_argument("--no-faults", action="store_true", help="skip the detection/recovery runs")
    ap.add_argument("--fault-repeats", type=int, default=3,
                    help="runs of each fault (kill, freeze, GIL hang, interleaved); the table gives their median and range")
    ap.add_argument("--ddp-malloc", choices=("tuned", "both"), default="tuned",
                    help="both: also run plain DDP under glibc's own malloc thresholds (ddp-glibc)")
    ap.add_argument("--ddp-sched", choices=("tuned", "both"), default="both",
                    help="both (the default): also run DDP under the OS's default thread scheduling "
                         "(ddp-os-sched); tuned: only DDP scheduled as phalanx's workers are")
    ap.add_argument("--ddp-again", action="store_true",
                    help="also run DDP a second time, set up exactly as 'ddp' (an A/A control): its ratio to "
                         "'ddp' shows how far this machine's noise alone moves a ratio whose true value is 1")
    ap.add_argument("--out", default="runs/bench/training.json")
    args = ap.parse_args()
    con = Console(stderr=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    workloads = [w for w in args.workloads.split(",") if w]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        ap.error(f"unknown workload(s) {', '.join(bad)}: choose from {', '.join(WORKLOADS)}")
    counts = [int(x) for x in args.workers.split(",") if x]
    with tempfile.TemporaryDirectory() as tmp:
        def save(rows: list[dict[str, Any]]) -> None:  # after every row: a long run loses nothing
            out.write_text(json.dumps({"command": "python -m phalanx.bench training " + " ".join(sys.argv[1:]),
                                       "partial": True, "rows": rows}, indent=2))

        systems = SYSTEMS + (("ddp-glibc",) if args.ddp_malloc == "both" else ()) + \
            (("ddp-os-sched",) if args.ddp_sched == "both" else ()) + (("ddp-again",) if args.ddp_again else ())
        rows = compare(workloads, counts, args.repeats, con, Path(tmp), save, systems)
        records: dict[str, list[dict[str, Any]]] = {kind: [] for kind in FAULTS}
        for i in range(0 if args.no_faults else max(args.fault_repeats, 1)):
            for kind, text in FAULTS.items():
                con.print(f"fault run {i + 1}/{args.fault_repeats}: {kind}")
                res = run_phalanx(4, 60, Path(tmp) / f"fault-{kind}-{i}", text)
                records[kind] += res.faults[:1]
        faults = {kind: fault_summary(runs) for kind, runs in records.items() if runs}
    result = {"command": "python -m phalanx.bench training " + " ".join(sys.argv[1:]), "repeats": args.repeats,
              "warmup_steps": WARMUP_STEPS, "rows": rows, "faults": faults, "unix_s": time.time()}
    out.write_text(json.dumps(result, indent=2))
    _print_tables(rows, systems, faults)
    print(f"wrote {out}")
    return 0




if __name__ == "__main__":
    sys.exit(main())
