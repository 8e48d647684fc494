"""The real router with real replica processes: when it ejects a slow replica, the requests already waiting
there (unary, and a stream that has sent nothing yet) move to a fast one, each answered once, and the slow
replica's slot is freed (the moved generations were cancelled there)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from phalanx.core.auth import read_token_file
from phalanx.serve.cluster import spawn_replicas, stop_replicas
from phalanx.serve.request_auth import ClusterTokenAuth
from phalanx.serve.router import Router, RouterConfig
from phalanx.serve.routing_policy import Policy, PolicyConfig
from phalanx.serve.stream_relay import open_stream, relay_stream

STEP_S, SLOW_FACTOR, TOKENS = 0.05, 20, 8  # the slow replica needs 8 x 1 s per request, one at a time
PATH = "/v1/completions"


def _body(seed: int, **kw: object) -> dict:
    return {"model": "phalanx-charlm", "prompt": "The ", "max_tokens": TOKENS, "seed": seed, **kw}


def _busy(url: str, token: bytes) -> int:
    h = httpx.get(url + "/health", auth=ClusterTokenAuth(token), timeout=5).json()
    return int(h["batch_size"]) + int(h.get("queue_depth", 0))


def _direct_text(url: str, token: bytes, seed: int) -> str:
    with httpx.Client(auth=ClusterTokenAuth(token), timeout=30) as c:
        return c.post(url + PATH, json=_body(seed)).json()["choices"][0]["text"]


def test_an_ejected_replica_hands_its_waiting_requests_to_a_fast_one_each_answered_once(token_file):
    token = read_token_file(token_file)
    reps = spawn_replicas(2, ["--random-weights", "0", "--batch-size-max", "1", "--min-step-s", str(STEP_S)],
                          token_file, {1: ["--slowdown-factor", str(SLOW_FACTOR)]})
    fast, slow = reps[0], reps[1]
    try:
        expected = {seed: _direct_text(fast.url, token, seed) for seed in (1, 2, 3, 4)}  # the same seed, any replica
        router = Router({"fast": fast.url, "slow": slow.url},
                        RouterConfig(policy=PolicyConfig(policy=Policy.ROUND_ROBIN)), token=token)
        f, s = router.replicas["fast"], router.replicas["slow"]
        s.stats.healthy = True  # the fast one is not admitted yet: everything lands on the slow one
        s.stats.observe(SLOW_FACTOR * STEP_S * TOKENS, router.cfg.policy.ewma_alpha)
        f.stats.observe(STEP_S * TOKENS, router.cfg.policy.ewma_alpha)

        async def scenario() -> tuple[list, str, float]:
            for r in (f, s):
                await router._poll(r)  # learns each replica's version (a moved stream stays on its version)
            unary = [asyncio.ensure_future(router.unary(PATH, _body(seed))) for seed in (1, 2, 3)]
            await asyncio.sleep(0.3)
            first = await open_stream(router, PATH, _body(4, stream=True), frozenset())  # queued behind them
            assert first[0] is s
            for _ in range(100):  # bounded: 10 s; all four waiting on the slow replica
                if len(s.held) == 3 and _busy(slow.url, token) == 4:
                    break
                await asyncio.sleep(0.1)
            stream = asyncio.ensure_future(_collect(router, first))
            await asyncio.sleep(0.2)  # the stream is held too (no token yet)
            t0 = time.monotonic()
            f.stats.healthy = True
            s.stats.ejected_until_s = t0 + 60  # what latency_outliers decides in _decide_membership
            router._ejected(s, "latency", "test: ejected as a latency outlier", t0)
            answers = await asyncio.gather(*unary)
            text = await stream
            router.close_connections()
            await router.client.aclose()
            return answers, text, time.monotonic() - t0

        answers, stream_text, took_s = asyncio.run(scenario())
        # the oldest (running, owes < 8 s) may stay; the three behind it would have waited 16-32 s: they move
        assert router.moves_total >= 3
        assert sum(1 for line in router.events if "moved" in line) == router.moves_total
        assert all(status == 200 for status, _, _ in answers)
        assert [json.loads(p)["choices"][0]["text"] for _, p, _ in answers] == [expected[s] for s in (1, 2, 3)]
        assert stream_text == expected[4]  # the moved stream: the same text, sent once
        assert took_s < 2 * SLOW_FACTOR * STEP_S * TOKENS  # well before the slow replica's 32 s backlog
        deadline = time.monotonic() + 3 * SLOW_FACTOR * STEP_S * TOKENS
        while time.monotonic() < deadline and _busy(slow.url, token):  # bounded: what stayed finishes (<= 8 s)
            time.sleep(0.1)
        assert _busy(slow.url, token) == 0  # the moved generations were cancelled there, nothing left behind
    finally:
        stop_replicas(reps)


async def _collect(router: Router, first) -> str:
    text = ""
    async for raw in relay_stream(router, PATH, _body(4, stream=True), first, False, time.monotonic()):
        data = raw.decode().removeprefix("data: ").strip()
        if data != "[DONE]":
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            text += "".join(c.get("text") or "" for c in chunk.get("choices") or [])
    return text
