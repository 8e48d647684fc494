"""The router's hedging with real replica processes: a request stuck on a slow replica is answered by a
hedge to a fast one, and the loser's generation is cancelled at the slow replica (its slot freed)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from phalanx.core.auth import read_token_file
from phalanx.serve.cluster import spawn_replicas, stop_replicas
from phalanx.serve.request_auth import ClusterTokenAuth
from phalanx.serve.router import Router, RouterConfig

STEP_S, SLOW_FACTOR, TOKENS = 0.05, 20, 8  # the slow replica needs >= 8 x 1 s for the whole answer


def _busy(url: str, token: bytes) -> int:
    h = httpx.get(url + "/health", auth=ClusterTokenAuth(token), timeout=5).json()
    return int(h["batch_size"]) + int(h.get("queue_depth", 0))


def test_a_request_on_a_slow_replica_is_hedged_to_a_fast_one_and_the_loser_is_cancelled(token_file):
    token = read_token_file(token_file)
    reps = spawn_replicas(2, ["--random-weights", "0", "--batch-size-max", "1", "--min-step-s", str(STEP_S)],
                          token_file, {1: ["--slowdown-factor", str(SLOW_FACTOR)]})
    fast, slow = reps[0], reps[1]
    try:
        router = Router({"fast": fast.url, "slow": slow.url}, RouterConfig(hedging=True), token=token)
        f, s = router.replicas["fast"], router.replicas["slow"]
        for r, per_request_s in ((f, STEP_S * TOKENS), (s, SLOW_FACTOR * STEP_S * TOKENS)):
            r.stats.healthy = True
            r.stats.observe(per_request_s, router.cfg.policy.ewma_alpha)
        for _ in range(router.cfg.policy.hedge_min_samples):  # a history: hedge after its p95 (0.4 s)
            router.history.add(STEP_S * TOKENS)
        router.requests_total = 100  # the hedge budget: 10 % of the requests served so far
        body = json.dumps({"model": "phalanx-charlm", "prompt": "The ", "max_tokens": TOKENS, "seed": 3}).encode()

        async def call() -> tuple[int, float]:
            t0 = time.monotonic()
            try:
                status, _, _ = await router._hedged(s, "/v1/completions", body, {"slow"}, None)  # primary: slow
            finally:
                router.close_connections()  # the winner's pooled connection (the loser's was closed on cancel)
            return status, t0

        status, t0 = asyncio.run(call())
        slow_answer_s = SLOW_FACTOR * STEP_S * TOKENS  # what the slow replica alone needs (8 s)
        assert status == 200 and router.hedges_total == 1
        assert time.monotonic() - t0 < slow_answer_s / 2  # the hedge answered, long before the slow replica could
        while time.monotonic() < t0 + 0.6 * slow_answer_s and _busy(slow.url, token):  # bounded: 4.8 s
            time.sleep(0.1)
        assert _busy(slow.url, token) == 0  # the loser was cancelled there: slot free, 3 s before it would finish
    finally:
        stop_replicas(reps)
