"""The serving speed sections of `python -m phalanx.bench serving` (issue 13): router overhead against
calling the replica directly (one request at a time and open-loop Poisson at 200 req/s, on asyncio + h11
and on uvloop + httptools in one run) and continuous batching (tokens/s of 32 concurrent generations
against 1, whole answers and SSE streams).

Both drive the replica and the router with the router's own lean keep-alive client
(``serve.replica_client``): on a 2-core box the httpx load generator's own CPU decided these figures.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from phalanx.core.auth import read_token_file
from phalanx.serve.cluster import spawn_replicas, spawn_router, stop_replicas
from phalanx.serve.loadtest import quantile

MODEL_ARGS = ["--random-weights", "0"]  # untrained weights of the bundled model's shape: timing only


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


async def _poisson_lean_s(url: str, token: bytes | None, rate: float, duration_s: float, seed: int = 7
                          ) -> tuple[list[float], int]:
    """Open-loop Poisson arrivals of 1-token completions over the router's own keep-alive client (one pooled
    connection per request in flight): a generator that costs ~0.1 ms of CPU per request, so that at 200 req/s
    on a 2-core box the replica and the router decide the latencies, not the client (the httpx loadtest
    client's own CPU saturated the box: direct p50 30 to 200 ms). Returns (latencies, failed)."""
    import random

    from phalanx.serve.replica_client import ReplicaConnections

    c = ReplicaConnections(url, token)
    rng = random.Random(seed)
    lat: list[float] = []
    failed = 0

    async def one(i: int) -> None:
        nonlocal failed
        t0 = time.perf_counter()
        try:
            r = await c.post("/v1/completions", json.dumps({"model": "phalanx-charlm", "prompt": "The ", "max_tokens": 1,
                                                            "seed": i}).encode(), 30)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            failed += 1
            return
        if r.status == 200:
            lat.append(time.perf_counter() - t0)
        else:
            failed += 1

    await _open_loop(rate, duration_s, rng, lambda _at_s, i: one(i))
    c.close()
    return lat, failed


async def _open_loop(rate: float, duration_s: float, rng: Any,
                     launch: Callable[[float, int], Coroutine[Any, Any, None]]) -> None:
    """Open-loop Poisson arrivals at ``rate`` for ``duration_s``: ``launch(seconds since the start, i)``
    runs as a task at each; then waits (at most 60 s) for those still running."""
    tasks: set[asyncio.Task[None]] = set()
    start_s = next_s = time.monotonic()
    end_s, i = start_s + duration_s, 0
    while next_s < end_s:  # bounded by the duration
        await asyncio.sleep(max(0.0, next_s - time.monotonic()))
        t = asyncio.create_task(launch(next_s - start_s, i))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
        i += 1
        next_s += rng.expovariate(rate)
    if tasks:
        await asyncio.wait(tasks, timeout=60)


async def _interleaved_lean_s(direct_url: str, token: bytes | None, router_url: str, rate: float, duration_s: float,
                              block_s: float = 0.5, seed: int = 11) -> dict[str, Any]:
    """One open-loop Poisson stream of 1-token completions at ``rate`` that alternates its target every ``block_s``:
    the replica's public TCP port (direct, signed as the router signs) and the router. The replica sees a steady
    ``rate`` throughout; both sides share the same minutes of the box, so a load that drifts (another job starting
    on a shared 2-core machine) moves both alike instead of landing on one of two back-to-back 10 s runs (session
    15: two direct runs a minute apart differed by 0.5 ms p50). Blocks alternate which side goes first. Returns
    each side's latencies and failures."""
    import random

    from phalanx.serve.replica_client import ReplicaConnections

    clients = {"direct": ReplicaConnections(direct_url, token), "router": ReplicaConnections(router_url, None)}
    lat: dict[str, list[float]] = {"direct": [], "router": []}
    failed = {"direct": 0, "router": 0}
    rng = random.Random(seed)

    async def one(side: str, i: int) -> None:
        t0 = time.perf_counter()
        try:
            r = await clients[side].post("/v1/completions", json.dumps(
                {"model": "phalanx-charlm", "prompt": "The ", "max_tokens": 1, "seed": i}).encode(), 30)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            failed[side] += 1
            return
        if r.status == 200:
            lat[side].append(time.perf_counter() - t0)
        else:
            failed[side] += 1

    def side_at(at_s: float) -> str:
        block = int(at_s / block_s)
        return ("direct", "router")[(block + block // 2) % 2]  # D R R D D R R D ...: neither side always first

    await _open_loop(rate, duration_s, rng, lambda at_s, i: one(side_at(at_s), i))
    for c in clients.values():
        c.close()
    return {"latencies_s": lat, "failed": failed}


def router_overhead(token_file: Path, duration_s: float, rate: float = 200.0) -> dict[str, Any]:
    """The replica called directly and through the router, one request at a time and at ``rate`` req/s (open
    loop, lean client), first with both processes on asyncio + h11, then on uvloop + httptools (what
    `phalanx serve` runs when they are installed): the same box state for both. On uvloop, also the two
    interleaved in one stream (``_interleaved_lean_s``); the headline stays router p50 less the lower of the two
    direct runs' p50."""
    token = read_token_file(token_file)
    out: dict[str, Any] = {"rate_per_s": rate}
    for kind in ("asyncio", "auto"):
        reps = spawn_replicas(1, MODEL_ARGS + ["--batch-size-max", "32", "--event-loop", kind], token_file)
        router = spawn_router({"r0": reps[0].url}, token_file, extra=["--event-loop", kind])
        res: dict[str, Any] = {"event_loop": kind}
        try:
            for name, url, tok in (("sequential direct", reps[0].url, token), ("sequential router", router.url, None),
                                   ("sequential direct again", reps[0].url, token)):
                lat = asyncio.run(_sequential_s(url, tok, 400))
                res[name] = {"ok": len(lat), "p50_s": quantile(lat, 0.5), "p99_s": quantile(lat, 0.99)}
                print(f"[overhead {kind}] {name}: {res[name]}", flush=True)
            for name, url, tok in (("direct", reps[0].url, token), ("router", router.url, None),
                                   ("direct again", reps[0].url, token)):
                cpu0 = _cpu_s(router.proc.pid)
                lat, failed = asyncio.run(_poisson_lean_s(url, tok, rate, duration_s))
                res[name] = {"ok": len(lat), "errors": failed, "p50_s": quantile(lat, 0.5), "p99_s": quantile(lat, 0.99)}
                if name == "router":
                    res["router_cpu_ms_per_request"] = 1000 * (_cpu_s(router.proc.pid) - cpu0) / max(len(lat), 1)
                print(f"[overhead {kind}] {name}: {res[name]}", flush=True)
            if kind == "auto":  # the headline only (20 s more): the same comparison interleaved in 0.5 s blocks
                # over one 2 x duration_s Poisson stream (session 16)
                inter = asyncio.run(_interleaved_lean_s(reps[0].url, token, router.url, rate, 2 * duration_s))
                il = inter["latencies_s"]
                res["interleaved"] = {side: {"ok": len(il[side]), "errors": inter["failed"][side],
                                             "p50_s": quantile(il[side], 0.5), "p99_s": quantile(il[side], 0.99)}
                                      for side in ("direct", "router")}
                res["interleaved_added_p50_ms"] = 1000 * (res["interleaved"]["router"]["p50_s"] -
                                                          res["interleaved"]["direct"]["p50_s"])
                res["interleaved_added_p99_ms"] = 1000 * (res["interleaved"]["router"]["p99_s"] -
                                                          res["interleaved"]["direct"]["p99_s"])
                print(f"[overhead {kind}] interleaved: {res['interleaved']}", flush=True)
        finally:
            router.stop()
            stop_replicas(reps)
        for prefix, key in (("", ""), ("sequential ", "sequential_")):
            direct = [res[prefix + "direct"], res[prefix + "direct again"]]
            res[key + "added_p50_ms"] = 1000 * (res[prefix + "router"]["p50_s"] - min(d["p50_s"] for d in direct))
            res[key + "added_p99_ms"] = 1000 * (res[prefix + "router"]["p99_s"] - min(d["p99_s"] for d in direct))
        out[kind] = res
    out.update({k: v for k, v in out["auto"].items() if k != "event_loop"})  # the headline: what `phalanx serve` runs
    return out


async def _closed_loop_tokens_per_s(url: str, token: bytes, streams: int, duration_s: float, max_tokens: int,
                                    stream: bool) -> dict[str, Any]:
    """``streams`` clients, each sending its next completion as soon as the last one ends, over the router's
    lean keep-alive client: the httpx loadtest client's own CPU (its pool checks every connection on every
    request) capped 32 streams at ~2,400 tokens/s on 2 cores where this one reads ~5,000-7,000."""
    from phalanx.serve.replica_client import ReplicaConnections

    c = ReplicaConnections(url, token)
    done, failed = 0, 0
    end_s = time.monotonic() + duration_s

    async def client(k: int) -> None:
        nonlocal done, failed
        for i in range(1_000_000):  # bounded by the duration
            if time.monotonic() >= end_s:
                return
            body = {"model": "phalanx-charlm", "prompt": "The ", "max_tokens": max_tokens, "temperature": 0.8,
                    "seed": k * 1_000_003 + i, "stream": stream}
            try:
                r = await c.post("/v1/completions", json.dumps(body).encode(), 120)
            except (OSError, asyncio.IncompleteReadError, TimeoutError):
                failed += 1
                continue
            if r.status == 200 and (not stream or r.body.endswith(b"data: [DONE]\n\n")):
                done += 1
            else:
                failed += 1

    t0 = time.monotonic()
    await asyncio.gather(*(client(k) for k in range(streams)))
    wall_s = time.monotonic() - t0
    c.close()
    return {"ok": done, "errors": failed, "tokens_per_s": done * max_tokens / wall_s}


def batching(token_file: Path, duration_s: float, max_tokens: int = 48) -> dict[str, Any]:
    """tokens/s of one replica with 32 concurrent generations against 1, whole answers (as measured since session
    11) and SSE streams; the replica's torch threads as `phalanx serve` sets them (--threads 1)."""
    reps = spawn_replicas(1, MODEL_ARGS + ["--batch-size-max", "32", "--queue-depth-max", "64"], token_file)
    token = read_token_file(token_file)
    out: dict[str, Any] = {"max_tokens": max_tokens}
    try:
        for stream in (False, True):
            for streams in (1, 32):
                key = f"{streams}_streams" + ("_sse" if stream else "")
                out[key] = asyncio.run(_closed_loop_tokens_per_s(reps[0].url, token, streams, duration_s, max_tokens,
                                                                 stream))
                print(f"[batching] {key}: {out[key]}", flush=True)
    finally:
        stop_replicas(reps)
    out["ratio"] = out["32_streams"]["tokens_per_s"] / out["1_streams"]["tokens_per_s"]
    out["ratio_sse"] = out["32_streams_sse"]["tokens_per_s"] / out["1_streams_sse"]["tokens_per_s"]
    return out


def overhead_report(o: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    lines += ["", f"Router overhead at {o['rate_per_s']:.0f} req/s (open loop, lean client): +{o['added_p50_ms']:.2f} ms p50, "
                  f"+{o['added_p99_ms']:.2f} ms p99 (direct p50 {1000 * o['direct']['p50_s']:.2f} ms, "
                  f"routed p50 {1000 * o['router']['p50_s']:.2f} ms); the router spends "
                  f"{o['router_cpu_ms_per_request']:.2f} ms of CPU per request",
              f"... interleaved (direct and routed alternating every 0.5 s in one Poisson stream at that rate, "
              f"{o['interleaved']['direct']['ok']} direct, {o['interleaved']['router']['ok']} routed): +{o['interleaved_added_p50_ms']:.2f} ms p50, "
              f"+{o['interleaved_added_p99_ms']:.2f} ms p99 (direct p50 "
              f"{1000 * o['interleaved']['direct']['p50_s']:.2f} ms, routed "
              f"{1000 * o['interleaved']['router']['p50_s']:.2f} ms)" if "interleaved" in o else "... (not interleaved)",
              f"Router overhead one request at a time (no queue; lean keep-alive client): "
              f"+{o['sequential_added_p50_ms']:.2f} ms p50, +{o['sequential_added_p99_ms']:.2f} ms p99 (direct p50 "
              f"{1000 * o['sequential direct']['p50_s']:.2f} ms, routed "
              f"{1000 * o['sequential router']['p50_s']:.2f} ms)"]
    if "asyncio" in o:
        a = o["asyncio"]
        lines += [f"... the same on asyncio + h11 (router and replica; the figures above run on "
                  f"{'uvloop + httptools' if o['auto']['event_loop'] == 'auto' else 'asyncio'}): at {o['rate_per_s']:.0f} "
                  f"req/s +{a['added_p50_ms']:.2f} ms p50, +{a['added_p99_ms']:.2f} ms p99 (direct p50 "
                  f"{1000 * a['direct']['p50_s']:.2f} ms), router CPU {a['router_cpu_ms_per_request']:.2f} ms/request; "
                  f"one at a time +{a['sequential_added_p50_ms']:.2f} ms p50, +{a['sequential_added_p99_ms']:.2f} ms p99"]
    return lines


def batching_report(b: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    lines += ["", f"Continuous batching: {b['1_streams']['tokens_per_s']:.0f} tokens/s with 1 stream, "
                  f"{b['32_streams']['tokens_per_s']:.0f} with 32 ({b['ratio']:.1f}x)"]
    if "ratio_sse" in b:
        lines += [f"... streamed (SSE, a chunk per token): {b['1_streams_sse']['tokens_per_s']:.0f} tokens/s with 1, "
                  f"{b['32_streams_sse']['tokens_per_s']:.0f} with 32 ({b['ratio_sse']:.1f}x)"]
    return lines
