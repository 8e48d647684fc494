"""``fencing``: the topology changes under a stale epoch. A coordinator restarts while the workers
that hold the newest state are frozen and a worker that fell behind comes back first. With its
fencing floor (the highest quorum id and committed step its predecessor durably recorded) the new
coordinator issues ids above every old one and waits for the holders; without it, it reuses ids,
commits steps again and the model diverges. Runs in the simulator, whose checkers see every worker.

The switch is the simulator Cluster's public, lab-only field ``restart_fencing_floor`` (refused
outside a lab session, like every lab switch): False starts the replacement coordinator without
the floor; nothing in the protocol is edited.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from phalanx.lab.context import LabContext
from phalanx.lab.fallacies import bar_plot
from phalanx.lab.outcome import Outcome
from phalanx.lab.switches import ALL_ON, LabSwitches, off
from phalanx.sim.cluster import Cluster, SimResult
from phalanx.sim.scenario import Scenario

KINDS = {  # checker message -> the column it is counted in
    "was used by two different member sets": "quorum ids reused",
    "was committed again": "steps committed twice",
    "holds different parameters": "workers diverged at a step",
    "not above id": "ids not fenced",
}
VIOLATIONS_KEPT = 50  # the simulator keeps the first 50


def _scenario(workers: int, seed: int) -> Scenario:
    """w2 cut off 1-4 s (it falls behind), w0 and w1 (the holders) frozen 3.5-9.5 s, the coordinator
    killed at 3.7 s and back at 4.0 s, just as w2 reconnects."""
    return (Scenario(workers, seed).isolate(2, for_s=3.0, at_s=1.0)
            .freeze(0, for_s=6.0, at_s=3.5).freeze(1, for_s=6.0, at_s=3.5)
            .kill_coordinator(at_s=3.7, restart_after_s=0.3))


def _run(sw: LabSwitches, steps: int, seed: int) -> SimResult:
    sc = _scenario(3, seed)
    return Cluster(workers=sc.workers, steps=steps, seed=sc.seed, plan=sc.plan, max_virtual_s=120.0,
                   restart_fencing_floor=sw.fencing).run()


def tally(violations: list[str]) -> dict[str, int]:
    c: Counter[str] = Counter()
    for v in violations:
        for needle, kind in KINDS.items():
            if needle in v:
                c[kind] += 1
    return {kind: c.get(kind, 0) for kind in KINDS.values()}


def run(ctx: LabContext) -> Outcome:
    steps = 60 if ctx.quick else 150
    data: dict[str, Any] = {}
    rows = []
    for label, sw in (("fencing ON", ALL_ON), ("fencing OFF", off("fencing"))):
        ctx.say(f"coordinator restart under a stale epoch, {label} ...")
        r = _run(sw, steps, ctx.seed)
        t = tally(r.violations)
        data[label] = {**t, "violations": len(r.violations), "first_violations": r.violations[:5],
                       "commit_decisions_lost": r.summary["commit_decisions_lost"],
                       "steps_committed": r.summary["steps_committed"], "final_max_abs_diff": r.summary[
                           "reference_max_abs_diff"], "ok": r.ok}
        rows.append([label, *t.values(), r.summary["commit_decisions_lost"]])
    on, of = data["fencing ON"], data["fencing OFF"]
    held = on["violations"] == 0 and of["workers diverged at a step"] > 0
    capped = (" (the simulator keeps the first 50 violations: at least)"
              if of["violations"] >= VIOLATIONS_KEPT else "")
    para = (f"With its fencing floor the restarted coordinator waited for the frozen holders and the run had "
            f"{on['violations']} invariant violations. Without it, it took w2 (behind) for the cluster's state: "
            f"it reused {of['quorum ids reused']} quorum ids for other member sets, committed "
            f"{of['steps committed twice']} already-applied steps again, and "
            f"{of['workers diverged at a step']} times a worker held different parameters after a step than its "
            f"peers{capped}; {of['commit_decisions_lost']} commit decisions were lost. The quorum id is the "
            "fencing token: without a durable floor a new leader cannot tell its epochs from a dead one's.")
    return Outcome("fencing", "The topology changes: a coordinator restarts while the workers holding the newest "
                   "state are frozen and one that fell behind returns first. What keeps the stale epoch out?",
                   f"Simulator, 3 workers x {steps} steps: w2 cut off 1-4 s, w0 and w1 frozen 3.5-9.5 s, the "
                   "coordinator SIGKILLed at 3.7 s and restarted at 4.0 s; OFF = the restarted coordinator starts "
                   "without the durable floor of quorum ids and committed step its predecessor recorded.",
                   ["run", *KINDS.values(), "commit decisions lost"], rows, para,
                   "fencing on: 0 invariant violations; off: workers diverge", held, data,
                   {"violations.png": bar_plot("invariant violations", list(data),
                                               [float(d["violations"]) for d in data.values()], "count")})
