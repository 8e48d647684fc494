"""Load generator: open-loop Poisson arrivals (``rate_per_s``) or closed loop (``concurrency``).

Latency and time to first token are measured per request; errors and 429s are counted, never
retried (what the service does under load is the measurement).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True)
class LoadSpec:
    url: str
    duration_s: float = 10.0
    rate_per_s: float | None = None
    concurrency: int | None = None
    stream: bool = False
    max_tokens: int = 16
    prompt: str = "The "
    model: str = "phalanx-charlm"
    seed: int = 0
    timeout_s: float = 30.0
    api_key: str | None = None  # sent as a bearer key (a router started with --api-key)
    token: bytes | None = None  # sign requests with the cluster token (to load a replica directly)


@dataclass
class LoadResult:
    latencies_s: list[float] = field(default_factory=list)
    starts_s: list[float] = field(default_factory=list)  # when each answered request was sent, from the run's start
    ttfts_s: list[float] = field(default_factory=list)
    ok: int = 0
    errors: int = 0
    rejected_429: int = 0
    error_samples: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    t0: float = 0.0


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(spec: LoadSpec, r: LoadResult) -> dict[str, Any]:
    qs = {"p50": 0.5, "p90": 0.9, "p99": 0.99, "p99.9": 0.999}
    return {"spec": asdict(spec), "requests": r.ok + r.errors + r.rejected_429, "ok": r.ok, "errors": r.errors,
            "rejected_429": r.rejected_429, "wall_s": round(r.wall_s, 3),
            "throughput_per_s": round(r.ok / r.wall_s, 3) if r.wall_s else 0.0,
            "latency_s": {k: quantile(r.latencies_s, q) for k, q in qs.items()},
            "ttft_s": {k: quantile(r.ttfts_s, q) for k, q in qs.items()},
            "error_samples": r.error_samples[:10]}


async def _one(client: httpx.AsyncClient, spec: LoadSpec, seed: int, res: LoadResult) -> None:
    body = {"model": spec.model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "seed": seed,
            "temperature": 0.8, "stream": spec.stream}
    t0 = time.monotonic()
    ttft = None
    try:
        if spec.stream:
            async with client.stream("POST", spec.url + "/v1/completions", json=body, timeout=spec.timeout_s) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    _count_status(resp, res)
                    return
                done = False
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and ttft is None:
                        ttft = time.monotonic() - t0
                    if line == "data: [DONE]":
                        done = True
                if not done:
                    raise RuntimeError("stream ended without [DONE]")
        else:
            resp = await client.post(spec.url + "/v1/completions", json=body, timeout=spec.timeout_s)
            if resp.status_code != 200:
                _count_status(resp, res)
                return
            ttft = time.monotonic() - t0
    except (httpx.HTTPError, RuntimeError) as e:
        res.errors += 1
        res.error_samples.append(f"{type(e).__name__}: {e}")
        return
    res.ok += 1
    res.latencies_s.append(time.monotonic() - t0)
    res.starts_s.append(t0 - res.t0)
    if ttft is not None:
        res.ttfts_s.append(ttft)


def _count_status(resp: httpx.Response, res: LoadResult) -> None:
    if resp.status_code == 429:
        res.rejected_429 += 1
    else:
        res.errors += 1
        res.error_samples.append(f"HTTP {resp.status_code}: {resp.text[:200]}")


def poisson_arrivals_s(rate_per_s: float, duration_s: float, seed: int) -> list[float]:
    """The open-loop schedule (offsets from the start) ``run_load`` follows for this seed: the simulator
    replays the very same arrivals to compare with a real run."""
    rng, out, t = random.Random(seed), [], 0.0
    while t < duration_s:  # bounded: t grows by a positive draw each turn
        out.append(t)
        t += rng.expovariate(rate_per_s)
    return out


async def run_load(spec: LoadSpec, on_tick: Callable[[LoadResult, float], None] | None = None) -> LoadResult:
    res = LoadResult()
    from phalanx.serve.request_auth import ClusterTokenAuth

    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else None
    auth = ClusterTokenAuth(spec.token) if spec.token is not None else None
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=2048), headers=headers, auth=auth) as client:
        t0 = res.t0 = time.monotonic()
        end = t0 + spec.duration_s
        tasks: set[asyncio.Task[None]] = set()
        n = 0
        if spec.rate_per_s:
            for offset_s in poisson_arrivals_s(spec.rate_per_s, spec.duration_s, spec.seed):
                await asyncio.sleep(max(0.0, t0 + offset_s - time.monotonic()))
                t = asyncio.create_task(_one(client, spec, spec.seed * 1_000_003 + n, res))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                n += 1
                if on_tick and n % 10 == 0:
                    on_tick(res, time.monotonic() - t0)
        else:
            async def worker(w: int) -> None:
                i = 0
                while time.monotonic() < end:
                    await _one(client, spec, spec.seed * 1_000_003 + w * 100_000 + i, res)
                    i += 1
                    if on_tick:
                        on_tick(res, time.monotonic() - t0)
            await asyncio.gather(*(worker(w) for w in range(spec.concurrency or 1)))
        if tasks:
            await asyncio.wait(tasks, timeout=spec.timeout_s + 5)
        res.wall_s = time.monotonic() - t0
    return res


def dump(path: str, summary: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)
