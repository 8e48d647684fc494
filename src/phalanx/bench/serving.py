"""`python -m phalanx.bench serving`: the serving figures of issue 13, side by side in one run.

1. slow replica: 4 replicas serving one request at a time (the Ray Serve anchor's shape), one slowed
   10x by a straggler fault; Poisson load at 70 % of the healthy capacity measured in this run;
   p50 / p99 / p99.9 per policy, ratio to the all-healthy p99, extra requests from hedging;
2. failover: SIGKILL one of 4 replicas under load: p99 of the requests sent in the second after the
   kill against the p99 before it, failed requests;
3. router overhead: the same replica called directly and through the router at 200 req/s;
4. continuous batching: tokens/s with 32 concurrent streams against 1;
5. rollout: two rollouts (step 1 -> 2 -> 3) of 4 replicas under Poisson load from many sessions, in
   consistent and in available mode: failed, delayed and refused requests against version
   regressions per session (the trade-off of the two modes).

Replicas serve untrained weights (the bundled model's shape): timing does not depend on the values.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from phalanx.core.auth import read_token_file
from phalanx.serve.cluster import make_token_file, spawn_replicas, spawn_router, stop_replicas
from phalanx.serve.loadtest import LoadSpec, quantile, run_load, summarize
from phalanx.serve.request_auth import ClusterTokenAuth

SLOW_CASES = [("healthy", "p2c-latency", False), ("round-robin", "round-robin", False), ("p2c-queue", "p2c-queue", False),
              ("p2c-latency", "p2c-latency", False), ("p2c-latency+hedge", "p2c-latency", True)]
MODEL_ARGS = ["--random-weights", "0"]


def _service_time_s(url: str, token: bytes, max_tokens: int, n: int = 20) -> float:
    body = {"model": "phalanx-charlm", "prompt": "The ", "max_tokens": max_tokens, "temperature": 0.8}
    with httpx.Client(timeout=30, auth=ClusterTokenAuth(token)) as c:
        c.post(url + "/v1/completions", json=body)
        t0 = time.monotonic()
        for i in range(n):
            c.post(url + "/v1/completions", json=dict(body, seed=i))
    return (time.monotonic() - t0) / n


def _metric(url: str, name: str) -> float:
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name))


def _row(name: str, r: dict[str, Any], base_p99: float) -> str:
    lat = r["latency_s"]
    return (f"| {name} | {r['ok']} | {r['errors']} | {lat['p50']:.3f} | {lat['p99']:.3f} | {lat['p99.9']:.3f} | "
            f"{lat['p99'] / base_p99:.2f}x | {r.get('hedges', 0):.0f} ({100 * r.get('hedges', 0) / max(r['ok'], 1):.1f} %) |")


def _base_slowdown(token_file: Path, max_tokens: int, target_s: float) -> tuple[float, float]:
    """The slowdown that makes one request take ``target_s`` (mostly waiting, like the anchor's replicas:
    4 of them then run side by side on 2 cores); returns (factor, CPU time of one request)."""
    probe = spawn_replicas(1, MODEL_ARGS + ["--batch-size-max", "1"], token_file)
    try:
        cpu_s = _service_time_s(probe[0].url, read_token_file(token_file), max_tokens)
    finally:
        stop_replicas(probe)
    return max(1.0, target_s / cpu_s), cpu_s


def slow_replica(token_file: Path, duration_s: float, load: float, max_tokens: int, warmup_s: float = 3.0,
                 target_service_s: float = 0.5) -> dict[str, Any]:
    token = read_token_file(token_file)
    base, cpu_s = _base_slowdown(token_file, max_tokens, target_service_s)
    reps = spawn_replicas(5, MODEL_ARGS + ["--batch-size-max", "1", "--queue-depth-max", "10000"], token_file,
                          {i: ["--slowdown-factor", f"{base * (10 if i == 3 else 1):.3f}"] for i in range(5)})
    results: dict[str, Any] = {}
    try:
        urls = {r.replica_id: r.url for r in reps}
        service_s = _service_time_s(urls["r0"], token, max_tokens)
        rate = load * 4 / service_s
        print(f"[slow replica] one request: {cpu_s * 1000:.1f} ms CPU, {service_s * 1000:.1f} ms served (slowdown "
              f"{base:.2f}) -> load {rate:.1f} req/s", flush=True)
        for name, policy, hedging in SLOW_CASES:
            chosen = {k: v for k, v in urls.items() if k != ("r3" if name == "healthy" else "r4")}
            router = spawn_router(chosen, token_file, policy, hedging)
            try:  # a warm router (as in production): the first seconds teach it the replicas' latencies
                asyncio.run(run_load(LoadSpec(url=router.url, duration_s=warmup_s, rate_per_s=rate,
                                              max_tokens=max_tokens, timeout_s=60, seed=99)))
                hedges0 = _metric(router.url, "phalanx_router_hedges_total")
                res = asyncio.run(run_load(LoadSpec(url=router.url, duration_s=duration_s, rate_per_s=rate,
                                                    max_tokens=max_tokens, timeout_s=60)))
                results[name] = summarize(LoadSpec(url=router.url, rate_per_s=rate), res)
                results[name]["hedges"] = _metric(router.url, "phalanx_router_hedges_total") - hedges0
            finally:
                router.stop()
            lat = results[name]["latency_s"]
            print(f"  {name:20s} ok {results[name]['ok']:5d} err {results[name]['errors']:3d} p50 {lat['p50']:.3f} "
                  f"p99 {lat['p99']:.3f} p99.9 {lat['p99.9']:.3f}", flush=True)
    finally:
        stop_replicas(reps)
    sim = simulated_slow_replica(service_s, rate, duration_s + warmup_s)
    return {"service_time_s": service_s, "cpu_time_s": cpu_s, "rate_per_s": rate, "warmup_s": warmup_s,
            "results": results, "simulated": sim}


def simulated_slow_replica(service_s: float, rate: float, duration_s: float, seed: int = 0) -> dict[str, Any]:
    """The same scenario in ``phalanx sim serve`` (the router's own decision code in virtual time), for
    the simulator-against-real comparison (target: p50 and p99 within 15 %)."""
    from phalanx.serve.routing_policy import Policy
    from phalanx.serve.serving_faults import ServingFault
    from phalanx.serve.sim_serve import SimServeConfig, simulate
    from phalanx.sim.loop import VirtualTimeLoop

    out: dict[str, Any] = {}
    for name, policy, hedging in SLOW_CASES:
        faults = [] if name == "healthy" else [ServingFault("straggler", 3, 0.0, None, 10.0, 0)]
        loop = VirtualTimeLoop(seed)
        try:
            out[name] = loop.run_until_complete(simulate(SimServeConfig(
                replicas=4, rate_per_s=rate, duration_s=duration_s, service_s=service_s, slots=1,
                policy=Policy(policy), hedging=hedging, seed=seed), faults))
        finally:
            loop.close()
        out[name].pop("membership", None)
    return out


def failover(token_file: Path, duration_s: float, max_tokens: int, kill_at_s: float = 5.0) -> dict[str, Any]:
    reps = spawn_replicas(4, MODEL_ARGS + ["--batch-size-max", "8"], token_file)
    router = spawn_router({r.replica_id: r.url for r in reps}, token_file)
    try:
        service_s = _service_time_s(reps[0].url, read_token_file(token_file), max_tokens, n=10)
        # half the cores' worth of requests, and at most 15/s: each streamed request also costs the router and
        # the load generator CPU on the same cores (at 49 req/s a 2-core box was saturated before the kill)
        rate = min(15.0, 0.5 * min(4, os.cpu_count() or 1) / service_s)

        async def run() -> Any:
            load = asyncio.create_task(run_load(LoadSpec(url=router.url, duration_s=duration_s, rate_per_s=rate,
                                                         max_tokens=max_tokens, stream=True, timeout_s=60)))
            await asyncio.sleep(kill_at_s)
            reps[1].proc.send_signal(signal.SIGKILL)
            return await load

        res = asyncio.run(run())
    finally:
        router.stop()
        stop_replicas(reps)
    before = [lat for lat, t in zip(res.latencies_s, res.starts_s) if 1.0 <= t < kill_at_s]
    after = [lat for lat, t in zip(res.latencies_s, res.starts_s) if kill_at_s <= t < kill_at_s + 1.0]
    out = {"rate_per_s": rate, "ok": res.ok, "failed": res.errors, "rejected_429": res.rejected_429,
           "p99_before_s": quantile(before, 0.99), "p99_second_after_kill_s": quantile(after, 0.99),
           "requests_in_second_after": len(after)}
    print(f"[failover] {out}", flush=True)
    return out


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def _sequential_s(url: str, token: bytes | None, n: int) -> list[float]:
    """One request at a time over one keep-alive connection (the router's own lean client): what a
    request costs with no queue anywhere and almost no client overhead."""
    from phalanx.serve.replica_client import ReplicaConnections

    c = ReplicaConnections(url, token)
    out = []
    for i in range(n + 5):
        t0 = time.perf_counter()
        r = await c.post("/v1/completions", json.dumps({"model": "phalanx-charlm", "prompt": "The ", "max_tokens": 1,
                                                         "seed": i}).encode(), 30)
        if r.status == 200 and i >= 5:  # the first few warm the connection and the replica
            out.append(time.perf_counter() - t0)
    c.close()
    return out


def router_overhead(token_file: Path, duration_s: float, rate: float = 200.0) -> dict[str, Any]:
    reps = spawn_replicas(1, MODEL_ARGS + ["--batch-size-max", "32"], token_file)
    router = spawn_router({"r0": reps[0].url}, token_file)
    token = read_token_file(token_file)
    out: dict[str, Any] = {"rate_per_s": rate}
    try:
        for name, url, tok in (("sequential direct", reps[0].url, token), ("sequential router", router.url, None),
                               ("sequential direct again", reps[0].url, token)):
            lat = asyncio.run(_sequential_s(url, tok, 400))
            out[name] = {"ok": len(lat), "p50_s": quantile(lat, 0.5), "p99_s": quantile(lat, 0.99)}
            print(f"[overhead] {name}: {out[name]}", flush=True)
        for name, url, tok in (("direct", reps[0].url, token), ("router", router.url, None),
                               ("direct again", reps[0].url, token)):
            cpu0 = _cpu_s(router.proc.pid)
            res = asyncio.run(run_load(LoadSpec(url=url, duration_s=duration_s, rate_per_s=rate, max_tokens=1,
                                                token=tok, seed=7)))
            out[name] = {"ok": res.ok, "errors": res.errors, "p50_s": quantile(res.latencies_s, 0.5),
                         "p99_s": quantile(res.latencies_s, 0.99)}
            if name == "router":
                out["router_cpu_ms_per_request"] = 1000 * (_cpu_s(router.proc.pid) - cpu0) / max(res.ok, 1)
            print(f"[overhead] {name}: {out[name]}", flush=True)
    finally:
        router.stop()
        stop_replicas(reps)
    direct_p50 = min(out["direct"]["p50_s"], out["direct again"]["p50_s"])
    direct_p99 = min(out["direct"]["p99_s"], out["direct again"]["p99_s"])
    out["added_p50_ms"] = 1000 * (out["router"]["p50_s"] - direct_p50)
    out["added_p99_ms"] = 1000 * (out["router"]["p99_s"] - direct_p99)
    seq = [out["sequential direct"], out["sequential direct again"]]
    out["sequential_added_p50_ms"] = 1000 * (out["sequential router"]["p50_s"] - min(d["p50_s"] for d in seq))
    out["sequential_added_p99_ms"] = 1000 * (out["sequential router"]["p99_s"] - min(d["p99_s"] for d in seq))
    return out


def batching(token_file: Path, duration_s: float, max_tokens: int = 48) -> dict[str, Any]:
    reps = spawn_replicas(1, MODEL_ARGS + ["--batch-size-max", "32", "--queue-depth-max", "64"], token_file)
    token = read_token_file(token_file)
    out: dict[str, Any] = {"max_tokens": max_tokens}
    try:
        for streams in (1, 32):
            res = asyncio.run(run_load(LoadSpec(url=reps[0].url, duration_s=duration_s, concurrency=streams,
                                                max_tokens=max_tokens, token=token, timeout_s=120)))
            out[f"{streams}_streams"] = {"ok": res.ok, "errors": res.errors,
                                         "tokens_per_s": res.ok * max_tokens / res.wall_s}
            print(f"[batching] {streams} streams: {out[f'{streams}_streams']}", flush=True)
    finally:
        stop_replicas(reps)
    out["ratio"] = out["32_streams"]["tokens_per_s"] / out["1_streams"]["tokens_per_s"]
    return out


async def _session_load(url: str, rate: float, duration_s: float, sessions: int, seed: int = 0) -> dict[str, Any]:
    """Poisson arrivals, each from one of ``sessions`` (the ``user`` field); per response: its version,
    latency and status (no retries: a 503 is a refusal)."""
    import random

    rng = random.Random(seed)
    out: list[tuple[str, float, int, str]] = []  # (session, latency, status, version)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=256)) as c:
        async def one(i: int) -> None:
            user = f"s{rng.randrange(sessions)}"
            t0 = time.monotonic()
            try:
                r = await c.post(url + "/v1/completions", json={"model": "phalanx-charlm", "prompt": "The ",
                                                                 "max_tokens": 8, "seed": i, "user": user})
                out.append((user, time.monotonic() - t0, r.status_code, r.headers.get("x-phalanx-model-version", "")))
            except httpx.HTTPError:
                out.append((user, time.monotonic() - t0, 0, ""))

        tasks, t_end, i = [], time.monotonic() + duration_s, 0
        while time.monotonic() < t_end:  # bounded by the duration
            tasks.append(asyncio.create_task(one(i)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return {"responses": out}


def rollout_tradeoff(token_file: Path, duration_s: float, rate: float = 20.0, sessions: int = 50) -> dict[str, Any]:
    from phalanx.checkpoint.durable import write_checkpoint
    from phalanx.checkpoint.state_codec import capture_training_state
    from phalanx.serve.admin_client import request_rollout
    from phalanx.serve.served_model import random_model

    token = read_token_file(token_file)
    out: dict[str, Any] = {"rate_per_s": rate, "sessions": sessions, "duration_s": duration_s}
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-rollout-") as tmp:
        run = Path(tmp) / "train-bench"
        ckpts = [write_checkpoint(run, step, capture_training_state(random_model(step).model, None, {}), {})
                 for step in (1, 2, 3)]
        order = [f"{run.name}/{c.name}" for c in ckpts]
        for mode in ("consistent", "available"):
            reps = spawn_replicas(4, ["--checkpoint", str(ckpts[0]), "--batch-size-max", "8"], token_file)
            router = spawn_router({r.replica_id: r.url for r in reps}, token_file, extra=["--consistency", mode])
            try:
                async def run_case() -> tuple[dict[str, Any], list[Any]]:
                    load = asyncio.create_task(_session_load(router.url, rate, duration_s, sessions))
                    reports = []
                    for at_s, ckpt in ((0.2 * duration_s, ckpts[1]), (0.55 * duration_s, ckpts[2])):
                        await asyncio.sleep(max(0.0, at_s - (time.monotonic() - t0)))
                        reports.append(await asyncio.to_thread(request_rollout, router.url, token, str(ckpt)))
                    return await load, reports

                t0 = time.monotonic()
                res, reports = asyncio.run(run_case())
                waits = _metric(router.url, "phalanx_router_version_waits_total")
                refusals = _metric(router.url, "phalanx_router_version_refusals_total")
            finally:
                router.stop()
                stop_replicas(reps)
            out[mode] = _tradeoff_row(res["responses"], order, reports, waits, refusals)
            print(f"[rollout] {mode}: {out[mode]}", flush=True)
    return out


def _tradeoff_row(responses: list[Any], order: list[str], reports: list[Any], waits: float, refusals: float
                  ) -> dict[str, Any]:
    top: dict[str, int] = {}
    regressions, regressed = 0, set()
    for user, _, status, version in responses:  # in completion order: what each session saw, in turn
        if status != 200 or version not in order:
            continue
        rank = order.index(version)
        if rank < top.get(user, -1):
            regressions += 1
            regressed.add(user)
        top[user] = max(top.get(user, -1), rank)
    lat = [lat for _, lat, status, _ in responses if status == 200]
    return {"requests": len(responses), "ok": len(lat), "refused_503": sum(s == 503 for _, _, s, _ in responses),
            "failed": sum(s not in (200, 503) for _, _, s, _ in responses), "delayed": int(waits),
            "refused_by_router": int(refusals), "regressions": regressions, "sessions_regressed": len(regressed),
            "sessions": len(top), "p50_s": quantile(lat, 0.5), "p99_s": quantile(lat, 0.99),
            "rollouts_ok": [bool(r[1].get("ok")) for r in reports],
            "rollout_s": [r[1].get("took_s") for r in reports]}


def report(all_: dict[str, Any]) -> str:
    lines = []
    if "slow_replica" in all_:
        s = all_["slow_replica"]
        base = s["results"]["healthy"]["latency_s"]["p99"]
        lines += [f"Slow replica: 4 replicas x 1 request at a time, one 10x slow, Poisson {s['rate_per_s']:.1f} req/s "
                  f"(70 % of capacity; one request {1000 * s['service_time_s']:.0f} ms; measured after "
                  f"{s['warmup_s']:g} s of warm-up)", "",
                  "| policy | ok | failed | p50 s | p99 s | p99.9 s | p99 / healthy | hedges (extra) |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [_row(n, r, base) for n, r in s["results"].items()]
        if "simulated" in s:
            lines += ["", "Simulator against the real run (same service time, rate and fault; target within 15 %):", "",
                      "| policy | real p50 s | sim p50 s | real p99 s | sim p99 s | p99 sim / real |", "|---|---|---|---|---|---|"]
            for n, r in s["results"].items():
                sim = s["simulated"][n]["latency_s"]
                lines.append(f"| {n} | {r['latency_s']['p50']:.3f} | {sim['p50']:.3f} | {r['latency_s']['p99']:.3f} | "
                             f"{sim['p99']:.3f} | {sim['p99'] / r['latency_s']['p99']:.2f} |")
    if "failover" in all_:
        f = all_["failover"]
        ratio = (f["p99_second_after_kill_s"] or 0) / (f["p99_before_s"] or 1)
        lines += ["", f"Failover (SIGKILL 1 of 4 under {f['rate_per_s']:.1f} req/s, streamed): p99 before "
                      f"{f['p99_before_s']:.3f} s, in the second after the kill {f['p99_second_after_kill_s']:.3f} s "
                      f"({ratio:.2f}x), failed {f['failed']} of {f['ok'] + f['failed']}"]
    if "router_overhead" in all_:
        o = all_["router_overhead"]
        lines += ["", f"Router overhead at {o['rate_per_s']:.0f} req/s: +{o['added_p50_ms']:.2f} ms p50, "
                      f"+{o['added_p99_ms']:.2f} ms p99 (direct p50 {1000 * o['direct']['p50_s']:.2f} ms, "
                      f"routed p50 {1000 * o['router']['p50_s']:.2f} ms); the router spends "
                      f"{o['router_cpu_ms_per_request']:.2f} ms of CPU per request",
                  f"Router overhead one request at a time (no queue; lean keep-alive client): "
                  f"+{o['sequential_added_p50_ms']:.2f} ms p50, +{o['sequential_added_p99_ms']:.2f} ms p99 (direct p50 "
                  f"{1000 * o['sequential direct']['p50_s']:.2f} ms, routed "
                  f"{1000 * o['sequential router']['p50_s']:.2f} ms)"]
    if "rollout" in all_:
        ro = all_["rollout"]
        lines += ["", f"Rollout: 4 replicas, two rollouts (step 1 -> 2 -> 3) during {ro['duration_s']:g} s of Poisson "
                      f"{ro['rate_per_s']:g} req/s from {ro['sessions']} sessions (the `user` field), no client retries", "",
                  "| mode | requests | failed | delayed | refused (503) | regressions | sessions regressed | p50 s | p99 s "
                  "| rollouts s |", "|---|---|---|---|---|---|---|---|---|---|"]
        for mode in ("consistent", "available"):
            m = ro[mode]
            lines.append(f"| {mode} | {m['requests']} | {m['failed']} | {m['delayed']} | {m['refused_503']} | "
                         f"{m['regressions']} | {m['sessions_regressed']} of {m['sessions']} | {m['p50_s']:.3f} | "
                         f"{m['p99_s']:.3f} | {', '.join(str(x) for x in m['rollout_s'])} |")
    if "batching" in all_:
        b = all_["batching"]
        lines += ["", f"Continuous batching: {b['1_streams']['tokens_per_s']:.0f} tokens/s with 1 stream, "
                      f"{b['32_streams']['tokens_per_s']:.0f} with 32 ({b['ratio']:.1f}x)"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration-s", type=float, default=15.0)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--only", default="slow,failover,overhead,batching,rollout")
    ap.add_argument("--rollout-rate", type=float, default=20.0, help="req/s for the rollout case")
    ap.add_argument("--overhead-rate", type=float, default=200.0, help="req/s for the router-overhead case")
    ap.add_argument("--out", default="runs/bench-serving.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-serving-") as tmp:  # the token goes with the run
        return _run_sections(args, make_token_file(tmp))


def _run_sections(args: argparse.Namespace, token_file: Path) -> int:
    only = set(args.only.split(","))
    all_: dict[str, Any] = {}
    if "slow" in only:
        all_["slow_replica"] = slow_replica(token_file, args.duration_s, args.load, args.max_tokens)
    if "failover" in only:
        all_["failover"] = failover(token_file, max(args.duration_s, 10.0), args.max_tokens)
    if "overhead" in only:
        all_["router_overhead"] = router_overhead(token_file, min(args.duration_s, 10.0), args.overhead_rate)
    if "batching" in only:
        all_["batching"] = batching(token_file, min(args.duration_s, 10.0))
    if "rollout" in only:
        all_["rollout"] = rollout_tradeoff(token_file, max(args.duration_s, 10.0), args.rollout_rate)
    text = report(all_) + f"\n\n(load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
    print("\n" + text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(all_, indent=2))
    Path(args.out).with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
