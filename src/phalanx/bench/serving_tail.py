"""The slow-replica sections of `python -m phalanx.bench serving` (issue 13, session 12): every routing policy
on the same real replicas and arrival schedule, one replica 10x slow; the same cases replayed in the
simulator (the router's own decision code) with a service model calibrated from the real run, for the
simulator-against-real comparison; the floor no dispatcher can beat on the same schedule; and the
scenario in the simulator alone at 4 and 8 replicas over seeds (``--only simtail``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from phalanx.core.auth import read_token_file
from phalanx.serve.cluster import spawn_replicas, spawn_router, stop_replicas
from phalanx.serve.loadtest import LoadSpec, quantile, run_load, summarize
from phalanx.serve.request_auth import ClusterTokenAuth

MODEL_ARGS = ["--random-weights", "0"]  # untrained weights of the bundled model's shape: timing only
# (name, policy, hedging, router args): "round-robin, no ejection" is the routers in wide use, whose health checks
# a slow replica passes (passive outlier ejection off)
SLOW_CASES = [("healthy", "p2c-latency", False, []), ("round-robin, no ejection", "round-robin", False,
                                                     ["--outlier-ratio", "0"]),
              ("round-robin, no moves", "round-robin", False, ["--no-ejection-moves"]),
              ("round-robin", "round-robin", False, []), ("p2c-queue", "p2c-queue", False, []),
              ("p2c-latency", "p2c-latency", False, []), ("p2c-latency+hedge", "p2c-latency", True, [])]
FAILOVER_CASE = "SIGKILL of r1 (p2c-latency, 50 % load)"
WARMUP_SEED = 99

def service_times_s(url: str, token: bytes | None, max_tokens: int, n: int = 20) -> list[float]:
    """One request at a time, each timed: the service time of one request alone (no queue)."""
    body = {"model": "phalanx-charlm", "prompt": "The ", "max_tokens": max_tokens, "temperature": 0.8}
    out = []
    with httpx.Client(timeout=60, auth=ClusterTokenAuth(token) if token is not None else None) as c:
        c.post(url + "/v1/completions", json=body)
        for i in range(n):
            t0 = time.monotonic()
            c.post(url + "/v1/completions", json=dict(body, seed=i))
            out.append(time.monotonic() - t0)
    return out


def _wait_idle(urls: list[str], token: bytes, timeout_s: float = 90.0) -> None:
    """Until no replica has work queued or running (a case's leftovers must not delay the next case)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5, auth=ClusterTokenAuth(token)) as c:
        while time.monotonic() < deadline:  # bounded by the deadline
            try:
                hs = [c.get(u + "/health").json() for u in urls]
            except httpx.HTTPError:
                return
            if all(int(h.get("batch_size", 0)) + int(h.get("queue_depth", 0)) == 0 for h in hs):
                return
            time.sleep(0.5)


def metric_value(url: str, name: str) -> float:
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name))


def slow_replica(token_file: Path, duration_s: float, load: float, max_tokens: int, warmup_s: float = 3.0,
                 target_service_s: float = 0.25, failover_load: float = 0.5, replicas: int = 4) -> dict[str, Any]:
    """Every policy on the same ``replicas`` + 1 replica processes (the last but one 10x slow, the last its
    healthy stand-in; with 4: r3 and r4), one router per case,
    the same seeded Poisson schedule per case after a warm-up; then a SIGKILL of r1 under a healthy set. The
    simulator replays each case on the same schedule with a service model calibrated from this run (below)."""
    token = read_token_file(token_file)
    # each decode step paced to a fixed time (the replicas mostly wait, as the anchor's did, so 5 of them and the
    # router share 2 cores); r3's steps 10x that. (Scaling each step's own wall time instead, as before, multiplied
    # every scheduling delay of a busy box by the factor: service times drifted 2.5x between calibration and run.)
    pace_s = target_service_s / max_tokens
    n = replicas
    slow_id, stand_in = f"r{n - 1}", f"r{n}"
    reps = spawn_replicas(n + 1, MODEL_ARGS + ["--batch-size-max", "1", "--queue-depth-max", "10000",
                                           "--min-step-s", f"{pace_s:.4f}"], token_file,
                          {n - 1: ["--slowdown-factor", "10"]})
    results: dict[str, Any] = {}
    calib: dict[str, Any] = {}
    try:
        urls = {r.replica_id: r.url for r in reps}
        for rid in sorted(set(urls) - {"r0", slow_id}):  # the first requests of a fresh process are slow (allocations, lazy init)
            service_times_s(urls[rid], token, max_tokens, 5)
        service_times_s(urls["r0"], token, max_tokens, 5)
        samples = service_times_s(urls["r0"], token, max_tokens, 40)
        service_s = sum(samples) / len(samples)
        slow = service_times_s(urls[slow_id], token, max_tokens, 3)
        calib = {"service_samples_s": samples, "slow_factor": sorted(slow)[1] / sorted(samples)[len(samples) // 2]}
        rate = load * n / service_s
        print(f"[slow replica] one request: {service_s * 1000:.1f} ms served ({pace_s * 1000:.1f} ms a step; the slow "
              f"one {calib['slow_factor']:.1f}x) -> load {rate:.1f} req/s", flush=True)
        for name, policy, hedging, extra in SLOW_CASES:
            chosen = {k: v for k, v in urls.items() if k != (slow_id if name == "healthy" else stand_in)}
            results[name] = _slow_case(chosen, token_file, policy, hedging, extra, rate, duration_s, warmup_s,
                                       max_tokens)
            _wait_idle(list(urls.values()), token)
        healthy = {k: v for k, v in urls.items() if k != slow_id}
        calib["router_hop_s"] = _router_hop_s(healthy, token_file, token)
        results[FAILOVER_CASE] = _slow_case(healthy, token_file, "p2c-latency", False, [], rate * failover_load / load,
                                            duration_s, warmup_s, max_tokens, kill=reps[1])
    finally:
        stop_replicas(reps)
    out = {"service_time_s": service_s, "step_pace_s": pace_s, "rate_per_s": rate, "warmup_s": warmup_s,
           "duration_s": duration_s, "replicas": n, "calibration": calib, "results": results}
    out["simulated"], out["calibration"]["load_scale"] = simulated_slow_replica(out)
    out["oracle"] = oracle_bound(out)
    return out


def _slow_case(chosen: dict[str, str], token_file: Path, policy: str, hedging: bool, extra: list[str], rate: float,
               duration_s: float, warmup_s: float, max_tokens: int, kill: Any = None) -> dict[str, Any]:
    router = spawn_router(chosen, token_file, policy, hedging, extra=extra)
    try:  # a warm router (as in production): the first seconds teach it the replicas' latencies
        asyncio.run(run_load(LoadSpec(url=router.url, duration_s=warmup_s, rate_per_s=rate, max_tokens=max_tokens,
                                      timeout_s=60, seed=WARMUP_SEED)))
        hedges0 = metric_value(router.url, "phalanx_router_hedges_total")
        moves0 = metric_value(router.url, "phalanx_router_moves_total")
        spec = LoadSpec(url=router.url, duration_s=duration_s, rate_per_s=rate, max_tokens=max_tokens, timeout_s=60)

        async def measured() -> Any:
            load = asyncio.create_task(run_load(spec))
            if kill is not None:
                await asyncio.sleep(duration_s / 2)
                kill.proc.send_signal(signal.SIGKILL)
            return await load

        res = asyncio.run(measured())
        r = summarize(LoadSpec(url=router.url, rate_per_s=rate), res)
        r["hedges"] = metric_value(router.url, "phalanx_router_hedges_total") - hedges0
        r["moves"] = metric_value(router.url, "phalanx_router_moves_total") - moves0
        r["latencies_s"], r["starts_s"] = res.latencies_s, res.starts_s
        if kill is not None:
            r["kill_at_s"] = duration_s / 2
    finally:
        router.stop()
    lat = r["latency_s"]
    print(f"  {policy + ('+hedge' if hedging else ''):20s} ok {r['ok']:5d} err {r['errors']:3d} p50 {lat['p50']:.3f} "
          f"p99 {lat['p99']:.3f} p99.9 {lat['p99.9']:.3f} (load average {os.getloadavg()[0]:.1f})", flush=True)
    r["loadavg"] = os.getloadavg()[0]
    return r


def _router_hop_s(urls: dict[str, str], token_file: Path, token: bytes) -> float:
    """What the router adds to one request alone (1-token completions, median of 30, through it vs direct)."""
    router = spawn_router(urls, token_file)
    try:
        routed = sorted(service_times_s(router.url, None, 1, 30))
    finally:
        router.stop()
    direct = sorted(service_times_s(urls["r0"], token, 1, 30))
    return max(0.0, routed[15] - direct[15])


def _sim_case(bench: dict[str, Any], name: str, scale: float, seed: int = 0) -> dict[str, Any]:
    """One case of the benchmark in ``phalanx sim serve``: the router's own decision code on the same arrival
    schedule (warm-up, then the measured part), the replicas drawing the measured service times x ``scale``."""
    import dataclasses

    from phalanx.serve.loadtest import poisson_arrivals_s
    from phalanx.serve.routing_policy import Policy, PolicyConfig
    from phalanx.serve.serving_faults import ServingFault
    from phalanx.serve.sim_serve import ServeSim, SimServeConfig
    from phalanx.sim.loop import VirtualTimeLoop

    cal, real = bench["calibration"], bench["results"][name]
    rate, n = real["spec"]["rate_per_s"], bench.get("replicas", 4)
    case = {c[0]: c for c in SLOW_CASES}.get(name, (name, "p2c-latency", False, []))
    pcfg = PolicyConfig(outlier_latency_ratio=0.0 if "--outlier-ratio" in case[3] else PolicyConfig.outlier_latency_ratio,
                        ejection_moves="--no-ejection-moves" not in case[3])
    if "kill_at_s" in real:  # the failover case
        faults = [ServingFault("kill", 1, real["kill_at_s"], None, 1.0, 0)]
    else:
        faults = [] if name == "healthy" else [ServingFault("straggler", n - 1, 0.0, None, cal["slow_factor"], 0)]
    cfg = SimServeConfig(replicas=n, rate_per_s=rate, duration_s=bench["duration_s"], slots=1,
                         policy=Policy(case[1]), hedging=case[2], seed=seed, policy_config=pcfg,
                         arrivals_s=tuple(poisson_arrivals_s(rate, bench["duration_s"], 0)),
                         warmup_arrivals_s=tuple(poisson_arrivals_s(rate, bench["warmup_s"], WARMUP_SEED)),
                         service_samples_s=tuple(scale * x for x in cal["service_samples_s"]),
                         router_hop_s=cal.get("router_hop_s", 0.0))
    sim = ServeSim(dataclasses.replace(cfg), faults)
    loop = VirtualTimeLoop(seed)
    try:
        out = loop.run_until_complete(sim.run())
    finally:
        loop.close()
    out.pop("membership", None)
    out["latencies_s"], out["starts_s"] = sim.latencies_s, sim.starts_s
    return out


def _sim_seeds(bench: dict[str, Any], name: str, scale: float, seeds: int = 5) -> dict[str, Any]:
    """``_sim_case`` over several simulator seeds (service draws, the policy's own coin): medians of each
    quantile, so the simulated side of the comparison carries less of its own sampling noise."""
    import statistics

    runs = [_sim_case(bench, name, scale, seed) for seed in range(seeds)]
    out = dict(runs[0])  # seed 0's own latencies, starts and counts
    out["latency_s"] = {q: statistics.median(r["latency_s"][q] for r in runs) for q in ("p50", "p99", "p99.9")}
    out["hedges"] = statistics.median(r["hedges"] for r in runs)
    out["moves"] = statistics.median(r.get("moves", 0) for r in runs)
    out["seeds"] = seeds
    return out


def _fit_load_scale(bench: dict[str, Any]) -> float:
    """The factor on the alone-measured service times that makes the simulated all-healthy p50 equal the real
    one: what running 4 replicas, the router and the load generator side by side costs each request (the
    calibration run is the fault-free case, as the training fidelity benchmark's is)."""
    target = bench["results"]["healthy"]["latency_s"]["p50"]
    lo, hi = 0.3, 4.0
    for _ in range(14):  # bisection: the simulated p50 grows with the scale
        mid = (lo + hi) / 2
        if _sim_seeds(bench, "healthy", mid, 3)["latency_s"]["p50"] < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def simulated_slow_replica(bench: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """Every real case replayed in the simulator, uncalibrated (service times measured alone) and calibrated
    (scaled so the healthy p50 matches); target: p50 and p99 within 15 %."""
    scale = _fit_load_scale(bench)
    out: dict[str, Any] = {}
    for name in bench["results"]:
        raw, cal = _sim_seeds(bench, name, 1.0), _sim_seeds(bench, name, scale)
        out[name] = dict(cal, uncalibrated={"latency_s": raw["latency_s"]})
    return out, scale


def oracle_bound(bench: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """What the best possible dispatcher gets on the same schedule and service model: each request goes, on
    arrival, to the replica where it would finish first, knowing every request's service time in advance
    (no router can know more). Its p99 ratio is a floor for any routing policy on this scenario."""
    import random

    from phalanx.serve.loadtest import poisson_arrivals_s

    cal, scale = bench["calibration"], bench["calibration"]["load_scale"]
    rate, out = bench["results"]["healthy"]["spec"]["rate_per_s"], {}
    n = bench.get("replicas", 4)
    for name, factors in (("healthy", [1.0] * n), ("one 10x slow", [1.0] * (n - 1) + [cal["slow_factor"]])):
        rng, free, lat = random.Random(seed), [0.0] * n, []
        for t in poisson_arrivals_s(rate, bench["duration_s"], 0):
            base = scale * rng.choice(cal["service_samples_s"])
            k = min(range(n), key=lambda j: max(free[j], t) + base * factors[j])
            free[k] = max(free[k], t) + base * factors[k]
            lat.append(free[k] - t)
        out[name] = {"p50": quantile(lat, 0.5), "p99": quantile(lat, 0.99), "n": len(lat)}
    return out


def sim_tail(seeds: int = 5, duration_s: float = 300.0, service_s: float = 0.5, load: float = 0.7) -> dict[str, Any]:
    """The slow-replica scenario in the simulator only, 4 and 8 replicas, several seeds: each policy's p99 over
    the all-healthy p99 of the same seed, hedging with the rule before session 12 (any replica after the p95)
    beside the current one, and the floor no dispatcher can beat (``oracle_bound``'s rule). Seconds to run."""
    import random
    import statistics

    from phalanx.serve.loadtest import poisson_arrivals_s
    from phalanx.serve.routing_policy import HedgeRule, Policy, PolicyConfig
    from phalanx.serve.serving_faults import ServingFault
    from phalanx.serve.sim_serve import ServeSim, SimServeConfig
    from phalanx.sim.loop import VirtualTimeLoop

    cases = [("round-robin, no ejection", Policy.ROUND_ROBIN, False, PolicyConfig(outlier_latency_ratio=0.0)),
             ("round-robin", Policy.ROUND_ROBIN, False, PolicyConfig()), ("p2c-queue", Policy.P2C_QUEUE, False,
                                                                          PolicyConfig()),
             ("p2c-latency", Policy.P2C_LATENCY, False, PolicyConfig()),
             ("p2c-latency+hedge", Policy.P2C_LATENCY, True, PolicyConfig()),
             ("p2c-latency+hedge (any replica after p95)", Policy.P2C_LATENCY, True,
              PolicyConfig(hedge_rule=HedgeRule.ANY_AFTER_P95))]
    out: dict[str, Any] = {"seeds": seeds, "duration_s": duration_s, "service_s": service_s, "load": load}
    for n in (4, 8):
        rate = load * n / service_s
        ratios: dict[str, list[float]] = {}
        for seed in range(seeds):
            def one(policy: Policy, hedging: bool, pcfg: PolicyConfig, slow: bool) -> dict[str, Any]:
                faults = [ServingFault("straggler", n - 1, 0.0, None, 10.0, 0)] if slow else []
                loop = VirtualTimeLoop(seed)
                try:
                    return loop.run_until_complete(ServeSim(SimServeConfig(
                        replicas=n, rate_per_s=rate, duration_s=duration_s, service_s=service_s, slots=1, policy=policy,
                        hedging=hedging, seed=seed, policy_config=pcfg), faults).run())
                finally:
                    loop.close()

            healthy = one(Policy.P2C_LATENCY, False, PolicyConfig(), False)["latency_s"]["p99"]
            for name, policy, hedging, pcfg in cases:
                r = one(policy, hedging, pcfg, True)
                ratios.setdefault(name, []).append(r["latency_s"]["p99"] / healthy)
                ratios.setdefault(name + " hedges %", []).append(100 * r["hedges"] / max(r["requests"], 1))
            for label, factors in (("floor healthy", [1.0] * n), ("floor slow", [1.0] * (n - 1) + [10.0])):
                rng, free, lat = random.Random(seed), [0.0] * n, []
                for t in poisson_arrivals_s(rate, duration_s, seed):
                    base = service_s * rng.uniform(0.8, 1.2)
                    k = min(range(n), key=lambda j: max(free[j], t) + base * factors[j])
                    free[k] = max(free[k], t) + base * factors[k]
                    lat.append(free[k] - t)
                ratios.setdefault(label, []).append(quantile(lat, 0.99) or 0.0)
            ratios.setdefault("floor", []).append(ratios["floor slow"][-1] / ratios["floor healthy"][-1])
        out[f"{n}_replicas"] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                                for k, v in ratios.items()}
        print(f"[sim tail] {n} replicas: " + ", ".join(f"{k} {v['median']:.2f}" for k, v in out[f"{n}_replicas"].items()),
              flush=True)
    return out


def sim_tail_report(t: dict[str, Any]) -> list[str]:
    names = [k for k in t["4_replicas"] if not k.startswith("floor") and not k.endswith("hedges %")]
    lines = [f"Simulator, one replica 10x slow, {100 * t['load']:.0f} % of healthy capacity, 1 request at a time, "
             f"{1000 * t['service_s']:.0f} ms a request, {t['duration_s']:g} virtual s, p99 / healthy p99: median "
             f"(min-max) over {t['seeds']} seeds", "", "| case | 4 replicas | 8 replicas |", "|---|---|---|"]
    for k in names + ["floor"]:
        cells = []
        for n in (4, 8):
            v = t[f"{n}_replicas"][k]
            h = t[f"{n}_replicas"].get(k + " hedges %")
            cells.append(f"{v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})"
                         + (f", {h['median']:.1f} % hedges" if h and h["max"] > 0 else ""))
        lines.append(f"| {k if k != 'floor' else 'floor: knows every service time'} | {cells[0]} | {cells[1]} |")
    return lines + [""]


def slow_report(s: dict[str, Any]) -> list[str]:
    res, sims = s["results"], s.get("simulated", {})
    base = res["healthy"]["latency_s"]["p99"]
    cal = s["calibration"]
    lines = [f"Slow replica: {s.get('replicas', 4)} replicas x 1 request at a time, one {cal['slow_factor']:.1f}x slow, Poisson "
             f"{s['rate_per_s']:.1f} req/s (70 % of capacity; one request alone {1000 * s['service_time_s']:.0f} ms), "
             f"{s['duration_s']:g} s measured after {s['warmup_s']:g} s of warm-up; simulator calibrated with "
             f"service x {cal.get('load_scale', 1.0):.2f} (fitted on the healthy p50)", "",
             "| case | n | failed | p50 s | p99 s | p99.9 s | p99 / healthy | hedges (extra) | moves (sim) | sim p50 s "
             "| sim p99 s | p50 sim/real | p99 sim/real | uncalibrated p50, p99 sim/real | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, r in res.items():
        lat = r["latency_s"]
        row = (f"| {n} | {r['ok']} | {r['errors']} | {lat['p50']:.3f} | {lat['p99']:.3f} | {lat['p99.9']:.3f} | "
               f"{lat['p99'] / base:.2f}x | {r.get('hedges', 0):.0f} ({100 * r.get('hedges', 0) / max(r['ok'], 1):.1f} %) | "
               f"{r.get('moves', 0):.0f} ({sims.get(n, {}).get('moves', '-')}) |")
        if n in sims:
            sl = sims[n]["latency_s"]
            ul = sims[n]["uncalibrated"]["latency_s"]
            censored = " (real p99 censored: timeouts)" if r["errors"] else ""
            row += (f" {sl['p50']:.3f} | {sl['p99']:.3f} | {sl['p50'] / lat['p50']:.2f} | {sl['p99'] / lat['p99']:.2f}"
                    f"{censored} | {ul['p50'] / lat['p50']:.2f}, {ul['p99'] / lat['p99']:.2f} |")
        lines.append(row + f" {r.get('loadavg', 0):.1f} |")
    if "oracle" in s:
        o = s["oracle"]
        lines += ["", f"Floor (a dispatcher that knows every service time, same schedule and service model): healthy "
                      f"p99 {o['healthy']['p99']:.3f} s, one slow {o['one 10x slow']['p99']:.3f} s = "
                      f"{o['one 10x slow']['p99'] / o['healthy']['p99']:.2f}x healthy"]
    fo = next((k for k, r in res.items() if "kill_at_s" in r), None)
    if fo is not None and fo in sims:
        r, sm = res[fo], sims[fo]
        k = r["kill_at_s"]

        def after(d: dict[str, Any]) -> list[float]:
            return [x for x, t in zip(d["latencies_s"], d["starts_s"]) if k <= t < k + 1.0]

        ra, sa = after(r), after(sm)
        lines += ["", f"Failover, the second after the kill: real p99 {quantile(ra, 0.99) or 0:.3f} s (n {len(ra)}), "
                      f"sim p99 {quantile(sa, 0.99) or 0:.3f} s (n {len(sa)})"]
    return lines
