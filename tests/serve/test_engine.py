"""Replica engine: KV cache equals the training forward, continuous batching, pure sampling."""

from __future__ import annotations

import asyncio

import pytest
import torch

from phalanx.serve.engine import EngineConfig, ReplicaEngine
from phalanx.serve.errors import BadRequest, Overloaded
from phalanx.serve.kv_decoder import KvDecoder
from phalanx.serve.sampling import SamplingParams, sample_token, uniform_for
from phalanx.serve.served_model import random_model

SERVED = random_model(0)


def test_kv_cache_decoding_matches_the_full_forward():
    dec = KvDecoder(SERVED.model, slots=3)
    ids = SERVED.vocab.encode("def foo(x):\n    return")
    logits = dec.prefill(1, ids[:5])
    for i in range(5, len(ids)):
        full = SERVED.model(torch.tensor([ids[:i]]))[0, -1]
        torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)
        logits = dec.decode([1], [ids[i]], [i])[0]


def test_sampling_is_a_pure_function_of_seed_and_position():
    logits = torch.randn(50)
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    assert [sample_token(logits, p, i) for i in range(20)] == [sample_token(logits, p, i) for i in range(20)]
    assert uniform_for(7, 3) != uniform_for(8, 3)
    assert sample_token(logits, SamplingParams(temperature=0.0), 0) == int(torch.argmax(logits))
    # top_p tiny keeps only the most likely token
    assert sample_token(logits, SamplingParams(temperature=1.0, top_p=1e-9, seed=1), 0) == int(torch.argmax(logits))


async def _collect(gen) -> tuple[str, str]:
    text = ""
    while True:
        d = await asyncio.wait_for(gen.out.get(), 30)
        text += d.text
        if d.finish_reason:
            return text, d.finish_reason


def _run(coro):
    return asyncio.run(coro)


def test_requests_join_the_running_batch_and_a_resumed_generation_continues_token_for_token():
    async def main():
        eng = ReplicaEngine(SERVED, EngineConfig(batch_size_max=4, queue_depth_max=8))
        loop = asyncio.create_task(eng.run())
        prompt = SERVED.vocab.encode("The ")
        p = SamplingParams(max_tokens=30, temperature=0.9, seed=42)
        a = eng.submit(prompt, p)
        await asyncio.sleep(0.05)  # a is running; b, c join mid-way
        b = eng.submit(prompt, p)
        c = eng.submit(SERVED.vocab.encode("x = "), SamplingParams(max_tokens=10, temperature=0.0))
        (ta, ra), (tb, rb), (tc, rc) = await asyncio.gather(_collect(a), _collect(b), _collect(c))
        assert ta == tb and ra == rb == rc == "length" and len(ta) == 30 and len(tc) == 10
        # another replica given prompt + the first 12 tokens continues identically
        other = ReplicaEngine(SERVED, EngineConfig(batch_size_max=2))
        loop2 = asyncio.create_task(other.run())
        r = other.submit(prompt, p, resumed=SERVED.vocab.encode(ta[:12]))
        tr, _ = await _collect(r)
        assert ta[:12] + tr == ta
        assert eng.batch_size == 0 and eng.free_slots == 4
        loop.cancel()
        loop2.cancel()
    _run(main())


def test_stop_strings_end_generation_without_emitting_the_stop_text():
    async def main():
        eng = ReplicaEngine(SERVED, EngineConfig(batch_size_max=2))
        loop = asyncio.create_task(eng.run())
        p = SamplingParams(max_tokens=40, temperature=0.0)
        full, _ = await _collect(eng.submit(SERVED.vocab.encode("ab"), p))
        stop = full[5:7]
        text, reason = await _collect(eng.submit(SERVED.vocab.encode("ab"), SamplingParams(max_tokens=40, temperature=0.0, stop=(stop,))))
        assert reason == "stop" and text == full[: full.find(stop)]
        loop.cancel()
    _run(main())


def test_bounded_queue_refuses_and_cancel_frees_the_slot():
    async def main():
        eng = ReplicaEngine(SERVED, EngineConfig(batch_size_max=1, queue_depth_max=1))
        loop = asyncio.create_task(eng.run())
        p = SamplingParams(max_tokens=60, temperature=0.0)
        ids = SERVED.vocab.encode("a")
        a = eng.submit(ids, p)
        await asyncio.sleep(0.02)
        eng.submit(ids, p)
        with pytest.raises(Overloaded):
            eng.submit(ids, p)
        with pytest.raises(BadRequest):
            eng.submit(ids * 60, p)
        eng.cancel(a)
        _, reason = await _collect(a)
        assert reason == "cancelled"
        loop.cancel()
    _run(main())
