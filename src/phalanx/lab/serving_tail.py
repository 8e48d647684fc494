"""``serving-tail``: one slow replica, routing policies side by side.

The serving benchmark's slow-replica case (bench/serving.py: five replicas, one 10x slow, a router
process per policy, load at a share of the measured capacity), built from the serve layer's public
pieces (serve/cluster.py replica and router processes under a fresh cluster token, serve/loadtest.py
Poisson load and percentiles) so that its short form fits ``phalanx lab all --quick``: the
benchmark's own ``slow_replica`` (being reworked in the same tree) took 2.5 minutes in its short
form here. Real processes on loopback, the same load for every policy.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx

from phalanx.lab.context import LabContext
from phalanx.lab.outcome import Outcome, new_figure, png
from phalanx.serve.cluster import make_token_file, spawn_replicas, spawn_router, stop_replicas
from phalanx.serve.errors import ServeError
from phalanx.serve.loadtest import LoadSpec, run_load, summarize

QUESTION = ("One replica of five is 10x slower. What does each routing policy do to the latency tail: does the "
            "slow replica set everyone's p99, or does the router route around it?")
SLOW_REPLICA = 3
MAX_TOKENS = 16
LOAD = 0.5  # share of the capacity: 4 replicas compute side by side only as far as there are cores


# Round-robin runs last: it leaves a backlog on the slow replica (every fourth request, at a tenth
# of the speed) that outlives its router and would otherwise land on the next policy's clock.
# case -> (routing policy, hedging, passive outlier ejection), as the serving benchmark's slow-replica
# cases. "round-robin" is the naive router of the routers in wide use: it takes a replica out only when
# its health checks fail, which a slow replica's never do; "round-robin+ejection" is the same rotation
# with phalanx's passive ejection (latency EWMA > 5x the others' median) on, as in every other case.
CASES = {"healthy": ("p2c-latency", False, True), "p2c-latency": ("p2c-latency", False, True),
         "p2c-latency+hedge": ("p2c-latency", True, True), "p2c-queue": ("p2c-queue", False, True),
         "round-robin+ejection": ("round-robin", False, True), "round-robin": ("round-robin", False, False)}


def _cases(quick: bool) -> list[tuple[str, str, bool, bool]]:
    names = ("healthy", "p2c-latency", "round-robin") if quick else tuple(CASES)
    return [(n, *CASES[n]) for n in names]


def run(ctx: LabContext) -> Outcome:
    if ctx.sim:
        ctx.say("no simulator form: running real replica processes")
    duration_s, warmup_s = (5.0, 2.0) if ctx.quick else (20.0, 3.0)
    token_file = make_token_file(ctx.out_dir / "serve")  # a fresh cluster token for this experiment, mode 600
    ctx.say("starting 5 replica processes (r3 10x slow) ...")
    reps = spawn_replicas(5, ["--random-weights", "0", "--batch-size-max", "1", "--queue-depth-max", "10000"],
                          token_file, {SLOW_REPLICA: ["--slowdown-factor", "10"]})
    results: dict[str, dict[str, Any]] = {}
    try:
        urls = {r.replica_id: r.url for r in reps}
        service_s = _service_time_s(urls, token_file, 8 if ctx.quick else 20)
        rate = LOAD * min(4, os.cpu_count() or 1) / service_s
        for name, policy, hedging, ejection in _cases(ctx.quick):
            # healthy: the four fast replicas; the others: three fast ones and the slow one
            chosen = {k: v for k, v in urls.items() if k != (f"r{SLOW_REPLICA}" if name == "healthy" else "r4")}
            ctx.say(f"{name}: {rate:.1f} req/s for {duration_s:g} s ...")
            router = spawn_router(chosen, token_file, policy, hedging, None if ejection else ["--outlier-ratio", "0"])
            try:
                _wait_until_serving(router.url)  # the router has seen its replicas healthy
                # a warm router, as in production: its first seconds teach it the replicas' latencies (the
                # naive router learns nothing it uses: its warm-up would only queue more on the slow replica)
                if ejection:
                    asyncio.run(run_load(LoadSpec(url=router.url, duration_s=warmup_s, rate_per_s=rate,
                                                  max_tokens=MAX_TOKENS, timeout_s=60, seed=99)))
                spec = LoadSpec(url=router.url, duration_s=duration_s, rate_per_s=rate, max_tokens=MAX_TOKENS,
                                timeout_s=60)
                results[name] = summarize(spec, asyncio.run(run_load(spec)))
            finally:
                router.stop()
    finally:
        stop_replicas(reps)
    return _outcome(results, service_s, rate, duration_s)


BODY = {"model": "phalanx-charlm", "prompt": "The ", "max_tokens": MAX_TOKENS, "temperature": 0.8}
WARM_DEADLINE_S = 30.0


def _wait_until_serving(url: str) -> None:
    """One request answered through the router (bounded retries): on a loaded machine a fresh
    router can answer 503 until its first health probes of the replicas come back."""
    deadline = time.monotonic() + WARM_DEADLINE_S
    with httpx.Client(timeout=10) as c:
        while True:
            try:
                if c.post(url + "/v1/completions", json=BODY).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServeError(f"the router at {url} served nothing within {WARM_DEADLINE_S:g} s")
            time.sleep(0.2)


def _service_time_s(urls: dict[str, str], token_file: Path, n: int) -> float:
    """One fast replica's time per request, unloaded, through a router (which signs the requests)."""
    router = spawn_router({"r0": urls["r0"]}, token_file, "round-robin")
    try:
        _wait_until_serving(router.url)
        with httpx.Client(timeout=30) as c:
            t0 = time.monotonic()
            for i in range(n):
                c.post(router.url + "/v1/completions", json=dict(BODY, seed=i)).raise_for_status()
        return (time.monotonic() - t0) / n
    finally:
        router.stop()


def _outcome(results: dict[str, dict[str, Any]], service_s: float, rate: float, duration_s: float) -> Outcome:
    base = results["healthy"]["latency_s"]["p99"] or 1e-9
    rows = [[name, r["ok"], r["errors"], r["latency_s"]["p50"], r["latency_s"]["p99"],
             round((r["latency_s"]["p99"] or 0) / base, 2)] for name, r in results.items()]
    rr, p2c = results.get("round-robin"), results.get("p2c-latency")
    held = bool(rr and p2c and rr["latency_s"]["p99"] > base and p2c["latency_s"]["p99"] < rr["latency_s"]["p99"])
    para = (f"Service time {service_s * 1000:.0f} ms per request, load {rate:.1f} req/s for {duration_s:g} s per "
            f"policy. All-healthy p99 {base:.3f} s. " + "; ".join(
                f"{n}: p99 {r['latency_s']['p99']:.3f} s ({(r['latency_s']['p99'] or 0) / base:.1f}x healthy), "
                f"{r['errors']} errors" for n, r in results.items() if n != "healthy")
            + ". Round-robin without ejection sends every fourth request to the slow replica, which cannot keep "
              "up, so its tail is the slow replica's backlog; a policy that measures latency routes around it, and "
              "passive ejection on the latency EWMA takes the slow replica out of any rotation.")
    return Outcome("serving-tail", QUESTION,
                   f"Real: 5 replica processes on loopback (one request at a time each; r{SLOW_REPLICA} 10x slow), one "
                   "router process per policy in front of 4 of them (healthy: the 4 fast; others: 3 fast + the slow "
                   f"one), each router but the naive one warmed for a few seconds, then Poisson load at {LOAD:.0%} of measured capacity, "
                   f"{MAX_TOKENS} tokens per request.",
                   ["policy", "ok", "errors", "p50 (s)", "p99 (s)", "p99 / healthy"], rows, para,
                   "round-robin's p99 is above healthy and p2c-latency's is below round-robin's", held,
                   {"service_time_s": service_s, "rate_per_s": rate, "results": results},
                   {"p99.png": _plot(results)})


def _plot(results: dict[str, dict[str, Any]]) -> bytes:
    fig, ax = new_figure(6.5, 3.4)
    names = list(results)
    p50 = [results[n]["latency_s"]["p50"] or 0 for n in names]
    p99 = [results[n]["latency_s"]["p99"] or 0 for n in names]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], p50, width=0.4, label="p50")
    ax.bar([x + 0.2 for x in xs], p99, width=0.4, label="p99")
    ax.set_xticks(list(xs), names, rotation=15, fontsize=8)
    ax.set_ylabel("latency (s)")
    ax.set_title("one replica 10x slow: latency by routing policy")
    ax.legend()
    return png(fig)
