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

from phalanx.bench.serving_speed import batching, batching_report, overhead_report, router_overhead
from phalanx.bench.serving_tail import (metric_value, oracle_bound, service_times_s, sim_tail, sim_tail_report,
                                       simulated_slow_replica, slow_replica, slow_report)
from phalanx.core.auth import read_token_file
from phalanx.serve.cluster import make_token_file, spawn_replicas, spawn_router, stop_replicas
from phalanx.serve.loadtest import LoadSpec, quantile, run_load

MODEL_ARGS = ["--random-weights", "0"]


def _service_time_s(url: str, token: bytes, max_tokens: int, n: int = 20) -> float:
    return sum(service_times_s(url, token, max_tokens, n)) / n


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
                waits = metric_value(router.url, "phalanx_router_version_waits_total")
                refusals = metric_value(router.url, "phalanx_router_version_refusals_total")
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
    if "sim_tail" in all_:
        lines += sim_tail_report(all_["sim_tail"])
    if "slow_replica" in all_:
        lines += slow_report(all_["slow_replica"])
    if "failover" in all_:
        f = all_["failover"]
        ratio = (f["p99_second_after_kill_s"] or 0) / (f["p99_before_s"] or 1)
        lines += ["", f"Failover (SIGKILL 1 of 4 under {f['rate_per_s']:.1f} req/s, streamed): p99 before "
                      f"{f['p99_before_s']:.3f} s, in the second after the kill {f['p99_second_after_kill_s']:.3f} s "
                      f"({ratio:.2f}x), failed {f['failed']} of {f['ok'] + f['failed']}"]
    if "router_overhead" in all_:
        lines += overhead_report(all_["router_overhead"])
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
        lines += batching_report(all_["batching"])
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration-s", type=float, default=15.0)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--replicas", type=int, default=4, help="slow-replica case: replicas in rotation (one of them slow)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--only", default="slow,failover,overhead,batching,rollout")
    ap.add_argument("--rollout-rate", type=float, default=20.0, help="req/s for the rollout case")
    ap.add_argument("--overhead-rate", type=float, default=200.0, help="req/s for the router-overhead case")
    ap.add_argument("--out", default="runs/bench-serving.json")
    ap.add_argument("--resim", default=None, help="a slow-replica JSON of an earlier run: replay its cases in the "
                    "simulator again (the real part is not rerun) and print the table")
    args = ap.parse_args()
    if args.resim:
        bench = json.loads(Path(args.resim).read_text())
        bench = bench.get("slow_replica", bench)
        bench["simulated"], bench["calibration"]["load_scale"] = simulated_slow_replica(bench)
        bench["oracle"] = oracle_bound(bench)
        print("\n".join(slow_report(bench)))
        return 0
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-serving-") as tmp:  # the token goes with the run
        return _run_sections(args, make_token_file(tmp))


def _run_sections(args: argparse.Namespace, token_file: Path) -> int:
    only = set(args.only.split(","))
    all_: dict[str, Any] = {}
    if "simtail" in only:
        all_["sim_tail"] = sim_tail()
    if "slow" in only:
        all_["slow_replica"] = slow_replica(token_file, args.duration_s, args.load, args.max_tokens,
                                            replicas=args.replicas)
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
