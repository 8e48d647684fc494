"""Simulator benchmark: timer events/s of phalanx's virtual-time loop against SimPy and a plain
asyncio loop, side by side in one run, plus wall time of a large simulated training run. The timer
rows run 100 chains with delays of 1-7 ms, so instants are shared; the "distinct instants" rows
(phalanx and SimPy alike) spread them as a cluster run's jittered latencies do. The "ceiling" row
is what this box's Python does with a heap alone, nothing run: events/s figures move several-fold
from one box to another, so read them against it and against SimPy in the same run.

    python -m phalanx.bench sim [--events 400000] [--scale-workers 1024] [--scale-steps 100]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

PROCS = 100  # concurrent timer chains, as in a simulation with many nodes


def _chain_count(total: int) -> int:
    return total // PROCS


# Spread added to chain i's delay (i * this) so that timers rarely share an instant, as in a
# cluster run (its network latencies are jittered); without it most instants are shared by ~26
# timers, which a loop that groups timers by instant handles for less per timer.
DISTINCT_INSTANTS_S = 1e-7


def bench_virtual_callbacks(total: int, spread_s: float = 0.0) -> float:
    from phalanx.sim.loop import run_virtual

    per = _chain_count(total)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        left = [PROCS]

        def chain(i: int, n: int) -> None:
            if n == 0:
                left[0] -= 1
                if left[0] == 0:
                    done.set_result(None)
                return
            loop.call_later(0.001 * (1 + i % 7) + i * spread_s, chain, i, n - 1)

        for i in range(PROCS):
            chain(i, per)
        await done

    t0 = time.perf_counter()
    _, loop = run_virtual(main(), 1)
    return loop.timer_events / (time.perf_counter() - t0)


def bench_virtual_tasks(total: int) -> float:
    from phalanx.sim.loop import run_virtual

    per = _chain_count(total)

    async def proc(i: int) -> None:
        for _ in range(per):
            await asyncio.sleep(0.001 * (1 + i % 7))

    async def main() -> None:
        await asyncio.gather(*(proc(i) for i in range(PROCS)))

    t0 = time.perf_counter()
    _, loop = run_virtual(main(), 1)
    return loop.timer_events / (time.perf_counter() - t0)


def bench_simpy(total: int, spread_s: float = 0.0) -> float:
    import simpy

    per = _chain_count(total)
    env = simpy.Environment()

    def proc(i: int) -> Any:
        for _ in range(per):
            yield env.timeout(0.001 * (1 + i % 7) + i * spread_s)

    for i in range(PROCS):
        env.process(proc(i))
    t0 = time.perf_counter()
    env.run()
    return PROCS * per / (time.perf_counter() - t0)


def bench_heap_ceiling(total: int) -> float:
    """This box's ceiling for any heap-driven virtual-time loop in Python: each event only pops
    its instant off a heapq of 100 and pushes the next (no callback, context, tie-break or timer
    object). No loop that runs callbacks reaches it; it tells a slow box from a slow loop."""
    import heapq

    events = PROCS * _chain_count(total)
    heap = [0.001 * (1 + i % 7) + i * DISTINCT_INSTANTS_S for i in range(PROCS)]
    heapq.heapify(heap)
    push, pop = heapq.heappush, heapq.heappop
    t0 = time.perf_counter()
    for _ in range(events):
        push(heap, pop(heap) + 0.004)
    return events / (time.perf_counter() - t0)


def bench_plain_asyncio(total: int) -> float:
    """The stock loop, with zero delays (it would otherwise wait out real time)."""
    per = _chain_count(total)

    async def proc() -> None:
        for _ in range(per):
            await asyncio.sleep(0)

    async def main() -> None:
        await asyncio.gather(*(proc() for _ in range(PROCS)))

    t0 = time.perf_counter()
    asyncio.run(main())
    return PROCS * per / (time.perf_counter() - t0)


def scale_plan(workers: int) -> str:
    kills = [workers * k // 6 + 1 for k in range(1, 6)]
    text = "".join(f'[[fault]]\nkind = "kill"\nworker = {w}\nat_step = {10 * (i + 1)}\n' for i, w in enumerate(kills))
    minority = list(range(workers - max(1, workers // 10), workers))
    return text + f'[[fault]]\nkind = "partition"\ngroups = [[0], {minority}]\nat_step = 60\nfor_s = 3.0\n'


def bench_scale(workers: int, steps: int) -> dict[str, Any]:
    from phalanx.faults.plan import parse_fault_plan
    from phalanx.sim.cluster import Cluster

    r = Cluster(workers=workers, steps=steps, seed=1, plan=parse_fault_plan(scale_plan(workers), "<scale>")).run()
    s = r.summary
    return {"workers": workers, "steps": steps, "ok": s["ok"], "wall_s": s["wall_s"], "virtual_s": s["virtual_s"],
            "steps_retried": s["steps_retried"], "timer_events": s["timer_events"],
            "faults": len(s["faults"]), "samples_exactly_once": s["samples_exactly_once"]}


def bench_ring(ranks: int) -> dict[str, Any]:
    from phalanx.sim.chunked import ring_allreduce_time, ring_formula_s

    t0 = time.perf_counter()
    r = ring_allreduce_time(ranks, 100_000_000, 20e-6, 1 / 1.25e9)
    wall_s = time.perf_counter() - t0
    return {"ranks": ranks, "messages": r.messages, "wall_s": round(wall_s, 3), "virtual_s": r.finish_s,
            "formula_s": ring_formula_s(ranks, 100_000_000, 20e-6, 1 / 1.25e9)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--events", type=int, default=400_000)
    ap.add_argument("--scale-workers", type=int, default=1024)
    ap.add_argument("--scale-steps", type=int, default=100)
    ap.add_argument("--ring-ranks", type=int, default=1024)
    ap.add_argument("--out", default="runs/bench/sim.json")
    args = ap.parse_args()
    console = Console(stderr=True)
    rates: dict[str, float] = {}
    distinct = functools.partial(bench_virtual_callbacks, spread_s=DISTINCT_INSTANTS_S)
    distinct_simpy = functools.partial(bench_simpy, spread_s=DISTINCT_INSTANTS_S)
    for name, fn in [("phalanx virtual loop (callbacks)", bench_virtual_callbacks),
                     ("phalanx virtual loop (asyncio tasks)", bench_virtual_tasks),
                     ("SimPy 4.1 (processes)", bench_simpy), ("plain asyncio (sleep 0)", bench_plain_asyncio),
                     ("phalanx virtual loop (callbacks, distinct instants)", distinct),
                     ("SimPy 4.1 (processes, distinct instants)", distinct_simpy),
                     ("ceiling: heapq pop + push alone, nothing run", bench_heap_ceiling)]:
        console.print(f"timer events: {name} ...")
        rates[name] = max(fn(args.events) for _ in range(2))
    ring = None
    if args.ring_ranks:
        console.print(f"per-chunk ring all-reduce over {args.ring_ranks} ranks ...")
        ring = bench_ring(args.ring_ranks)
    scale = None
    if args.scale_workers:
        console.print(f"scale: {args.scale_workers} workers x {args.scale_steps} steps, 5 crashes + a partition ...")
        scale = bench_scale(args.scale_workers, args.scale_steps)
    simpy_rate = rates["SimPy 4.1 (processes)"]
    t = Table(title="simulator benchmark (one core)")
    t.add_column("measure")
    t.add_column("value")
    t.add_column("vs SimPy")
    for k, v in rates.items():
        peer = rates["SimPy 4.1 (processes, distinct instants)"] if "distinct instants" in k else simpy_rate
        t.add_row(k, f"{v / 1e6:.3f} M events/s", f"{v / peer:.2f}x")
    if ring:
        t.add_row(f"per-chunk ring all-reduce, {ring['ranks']} ranks ({ring['messages']:,} messages)",
                  f"{ring['wall_s']:.2f} s wall", "")
    if scale:
        t.add_row(f"{scale['workers']} workers x {scale['steps']} steps, 5 crashes + partition",
                  f"{scale['wall_s']:.1f} s wall ({scale['virtual_s']:.1f} s virtual, ok={scale['ok']})", "")
    console.print(t)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"events_per_s": rates, "ring": ring, "scale": scale}, indent=2))
    print(f"wrote {out}")
    return 0
