"""`python -m phalanx.bench serving`: routing policies side by side with one replica 10x slow.

4 replicas, each serving one request at a time (as in the Ray Serve anchor), one slowed 10x by a
straggler fault; Poisson load at 70 % of the healthy capacity measured in the same run; p50 / p99 /
p99.9 for each policy with ratios to the all-healthy run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from phalanx.serve.cluster import spawn_replicas, stop_replicas
from phalanx.serve.loadtest import LoadSpec, run_load, summarize
from phalanx.serve.router_main import READY_LINE

CASES = [("healthy", "p2c-latency", False), ("round-robin", "round-robin", False), ("p2c-queue", "p2c-queue", False),
         ("p2c-latency", "p2c-latency", False), ("p2c-latency+hedge", "p2c-latency", True)]


def _router(urls: dict[str, str], policy: str, hedging: bool) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "phalanx.serve.router_main", "--port", "0", "--policy", policy,
           *[f"--replica={k}={v}" for k, v in sorted(urls.items())]] + (["--hedging"] if hedging else [])
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line.startswith(READY_LINE):
        p.kill()
        raise RuntimeError("router did not start")
    return p, f"http://127.0.0.1:{line.split()[1]}"


def _service_time_s(url: str, max_tokens: int, n: int = 20) -> float:
    body = {"model": "phalanx-charlm", "prompt": "The ", "max_tokens": max_tokens, "temperature": 0.8}
    with httpx.Client(timeout=30) as c:
        c.post(url + "/v1/completions", json=body)
        t0 = time.monotonic()
        for i in range(n):
            c.post(url + "/v1/completions", json=dict(body, seed=i))
    return (time.monotonic() - t0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out", default="runs/bench-serving.json")
    args = ap.parse_args()
    reps = spawn_replicas(5, ["--random-weights", "0", "--batch-size-max", "1", "--queue-depth-max", "10000"],
                          {3: ["--slowdown-factor", "10"]})
    results: dict[str, dict] = {}
    try:
        urls = {r.replica_id: r.url for r in reps}
        service_s = _service_time_s(urls["r0"], args.max_tokens)
        # 4 replicas compute in parallel only as far as there are cores (2 here): capacity is what the box can do
        rate = args.load * min(4, os.cpu_count() or 1) / service_s
        print(f"service time {service_s * 1000:.1f} ms -> capacity {rate / args.load:.1f} req/s; load {rate:.1f} req/s",
              flush=True)
        for name, policy, hedging in CASES:
            chosen = {k: v for k, v in urls.items() if k != ("r3" if name == "healthy" else "r4")}
            proc, url = _router(chosen, policy, hedging)
            try:
                res = asyncio.run(run_load(LoadSpec(url=url, duration_s=args.duration_s, rate_per_s=rate,
                                                    max_tokens=args.max_tokens, timeout_s=60)))
                results[name] = summarize(LoadSpec(url=url, rate_per_s=rate), res)
                results[name]["extra_requests_hedges"] = _metric(url, "phalanx_router_hedges_total")
            finally:
                proc.kill()
                proc.wait(10)
            lat = results[name]["latency_s"]
            print(f"{name:20s} ok {results[name]['ok']:5d} err {results[name]['errors']:3d} "
                  f"p50 {lat['p50']:.3f} p99 {lat['p99']:.3f} p99.9 {lat['p99.9']:.3f}", flush=True)
    finally:
        stop_replicas(reps)
    base = results["healthy"]["latency_s"]
    print("\n| policy | ok | failed | p50 s | p99 s | p99.9 s | p99 / healthy |\n|---|---|---|---|---|---|---|")
    for name, r in results.items():
        lat = r["latency_s"]
        print(f"| {name} | {r['ok']} | {r['errors']} | {lat['p50']:.3f} | {lat['p99']:.3f} | {lat['p99.9']:.3f} | "
              f"{lat['p99'] / base['p99']:.2f}x |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"service_time_s": service_s, "rate_per_s": rate, "results": results}, indent=2))
    return 0


def _metric(url: str, name: str) -> float:
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name))


if __name__ == "__main__":
    sys.exit(main())
