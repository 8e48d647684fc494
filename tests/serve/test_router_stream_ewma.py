"""What streams teach the router's latency EWMA, with real replicas: a replica serving long streams looks as
fast as one answering short unary requests at the same speed, and a 10x slow replica still looks slow when
all its traffic is streamed (each answer teaches its time per request of the fleet's typical size)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from phalanx.core.auth import read_token_file
from phalanx.serve.cluster import spawn_replicas, stop_replicas
from phalanx.serve.router import Router, RouterConfig
from phalanx.serve.routing_policy import PolicyConfig, latency_outliers
from phalanx.serve.stream_relay import open_stream, relay_stream

STEP_S = 0.02
PATH = "/v1/completions"


def _body(tokens: int, seed: int, stream: bool = False) -> dict:
    return {"model": "phalanx-charlm", "prompt": "The ", "max_tokens": tokens, "seed": seed, "stream": stream,
            "stop": []}


async def _stream_on(router: Router, rid: str, tokens: int, seed: int) -> None:
    others = frozenset(set(router.replicas) - {rid})
    first = await open_stream(router, PATH, _body(tokens, seed, True), others)  # only rid is left to choose
    assert first[0].stats.replica_id == rid
    async for raw in relay_stream(router, PATH, _body(tokens, seed, True), first, False, time.monotonic()):
        assert b'"error"' not in raw, raw


@pytest.mark.slow  # ~20 s: three paced replicas, sequential traffic
def test_long_streams_do_not_make_a_replica_look_slow_and_a_slow_one_looks_slow_on_streams_alone(token_file):
    token = read_token_file(token_file)
    reps = spawn_replicas(3, ["--random-weights", "0", "--batch-size-max", "4", "--min-step-s", str(STEP_S)],
                          token_file, {2: ["--slowdown-factor", "10"]})
    try:
        router = Router({r.replica_id: r.url for r in reps}, RouterConfig(), token=token)
        stats = {rid: r.stats for rid, r in router.replicas.items()}

        async def traffic() -> None:
            for r in router.replicas.values():
                await router._poll(r)  # versions (a stream stays on its version)
                r.stats.healthy = True
            for seed in range(4):  # r1: short unary answers (16 tokens, ~0.3 s each)
                data = json.dumps(_body(16, seed)).encode()
                status, _, _ = await router._hedged(router.replicas["r1"], PATH, data, set(), None)
                assert status == 200
            for seed in range(2):  # r0: long streams (48 tokens, ~1 s each) at the same speed
                await _stream_on(router, "r0", 48, seed)
            for seed in range(2):  # r2: 10x slow, streamed only (16 tokens, ~3 s each)
                await _stream_on(router, "r2", 16, seed)
            router.close_connections()
            await router.client.aclose()

        asyncio.run(traffic())
        fast = [stats["r0"].ewma_latency_s, stats["r1"].ewma_latency_s]
        assert all(stats[rid].samples >= 2 for rid in stats)
        # before session 13 a stream taught its time to first token: r0 looked ~8x faster than r1
        assert max(fast) / min(fast) < 2.5, stats
        assert stats["r2"].ewma_latency_s > 4 * max(fast), stats  # streams alone still show the straggler
        out = latency_outliers(time.monotonic(), list(stats.values()), PolicyConfig(outlier_min_samples=2))
        assert [s.replica_id for s, _ in out] == ["r2"]
    finally:
        stop_replicas(reps)
