"""Router with real replica processes: SIGKILL and SIGSTOP under load cost no request, streams resume exactly."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest

from phalanx.serve.cluster import spawn_replicas, spawn_router, stop_replicas

MODEL = "phalanx-charlm"
pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(token_file):
    # every step 15x slower so generations are still running when the fault lands
    reps = spawn_replicas(3, ["--random-weights", "0", "--slowdown-factor", "15", "--batch-size-max", "16"], token_file)
    router = spawn_router({r.replica_id: r.url for r in reps}, token_file)
    yield reps, router.url
    router.stop()
    stop_replicas(reps)


async def _streams(url: str, seeds: list[int]) -> dict[int, str]:
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)

    async def one(seed: int) -> tuple[int, str]:
        parts = []
        stream = await c.completions.create(model=MODEL, prompt="The ", max_tokens=40, temperature=0.9, seed=seed,
                                            stream=True)
        async for ch in stream:
            parts.append(ch.choices[0].text if ch.choices else "")
        return seed, "".join(parts)

    out = dict(await asyncio.gather(*(one(s) for s in seeds)))
    await c.close()
    return out


async def _unary(url: str, seeds: list[int]) -> dict[int, str]:
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    rs = await asyncio.gather(*(c.completions.create(model=MODEL, prompt="x = ", max_tokens=30, temperature=0.9,
                                                     seed=s) for s in seeds))
    await c.close()
    return {s: r.choices[0].text for s, r in zip(seeds, rs)}


def test_sigkill_mid_stream_loses_no_request_and_resumed_streams_are_identical(cluster):
    reps, url = cluster
    seeds = list(range(12))
    reference = asyncio.run(_streams(url, seeds))
    reference_unary = asyncio.run(_unary(url, seeds))
    assert all(len(t) == 40 for t in reference.values())

    async def with_fault() -> tuple[dict[int, str], dict[int, str]]:
        run = asyncio.gather(_streams(url, seeds), _unary(url, seeds))
        await asyncio.sleep(0.6)
        reps[1].proc.send_signal(signal.SIGKILL)
        return tuple(await run)

    t0 = time.monotonic()
    streamed, unary = asyncio.run(with_fault())
    assert streamed == reference  # every stream completed, byte for byte the fault-free text
    assert unary == reference_unary
    health = httpx.get(url + "/health", timeout=5).json()["replicas"]
    assert health["r1"]["healthy"] is False and time.monotonic() - t0 < 60
    m = httpx.get(url + "/metrics", timeout=5).text
    resumed = [float(x.split()[-1]) for x in m.splitlines() if x.startswith("phalanx_router_stream_resumptions_total")]
    assert resumed and resumed[0] >= 1  # the kill really landed mid-stream


def test_sigstop_takes_the_replica_out_of_rotation_within_a_second_and_no_request_fails(cluster):
    reps, url = cluster
    seeds = list(range(8))
    reference = asyncio.run(_streams(url, seeds))
    os.kill(reps[2].proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    out_after_s = None
    try:
        for _ in range(100):
            if not httpx.get(url + "/health", timeout=5).json()["replicas"]["r2"]["healthy"]:
                out_after_s = time.monotonic() - t0
                break
            time.sleep(0.02)
        assert out_after_s is not None and out_after_s <= 1.0, out_after_s
        assert asyncio.run(_streams(url, seeds)) == reference
    finally:
        os.kill(reps[2].proc.pid, signal.SIGCONT)
