"""What the speed work (issue 13, session 12) must not change: batched sampling gives each sequence the
token it gets alone, batched prefill and the cache-view decode compute what one-at-a-time does, a
non-streamed generation ends with the streamed one's text, and the serving processes run (and say so)
without uvloop/httptools."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import torch

from phalanx.serve import asgi_server
from phalanx.serve.cluster import spawn_replicas, stop_replicas
from phalanx.serve.engine import EngineConfig, ReplicaEngine
from phalanx.serve.kv_decoder import KvDecoder
from phalanx.serve.request_auth import ClusterTokenAuth
from phalanx.serve.sampling import SamplingParams, sample_token, sample_tokens, uniform_for
from phalanx.serve.served_model import random_model

SERVED = random_model(0)


def _reference_token(logits: torch.Tensor, p: SamplingParams, index: int) -> int:
    """The sampler before batching (session 11), one row at a time: the distribution must not change."""
    if p.temperature <= 0.0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    order = torch.argsort(probs, descending=True, stable=True)
    cum = torch.cumsum(probs[order], dim=0)
    keep = max(1, min(int(torch.searchsorted(cum, torch.tensor(p.top_p, dtype=cum.dtype)).item()) + 1, cum.numel()))
    kept = probs[order][:keep] / probs[order][:keep].sum()
    pick = int(torch.searchsorted(torch.cumsum(kept, dim=0), torch.tensor(uniform_for(p.seed, index), dtype=kept.dtype),
                                  right=True).item())
    return int(order[min(pick, keep - 1)].item())


def test_batched_sampling_gives_every_row_the_token_it_gets_alone_whatever_the_batch():
    g = torch.Generator().manual_seed(1)
    rng = random.Random(1)
    checked = 0
    for _ in range(60):
        b = rng.choice([1, 3, 8, 32])
        logits = torch.randn(b, 65, generator=g) * rng.choice([0.5, 2.0, 6.0])
        params = [SamplingParams(temperature=rng.choice([0.0, 0.4, 0.8, 1.0, 1.6]), top_p=rng.choice([1.0, 0.9, 0.3, 1e-9]),
                                 seed=rng.randrange(10_000)) for _ in range(b)]
        indices = [rng.randrange(64) for _ in range(b)]
        batched = sample_tokens(logits, params, indices)
        for i in range(b):
            alone = sample_token(logits[i].clone(), params[i], indices[i])
            assert batched[i] == alone == _reference_token(logits[i], params[i], indices[i]), (i, params[i])
            checked += 1
    assert checked > 500
    # shuffling the batch moves each row's token with it
    logits = torch.randn(16, 65, generator=g)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s) for s in range(16)]
    perm = list(range(16))
    rng.shuffle(perm)
    straight = sample_tokens(logits, params, list(range(16)))
    shuffled = sample_tokens(logits[perm], [params[i] for i in perm], perm)
    assert shuffled == [straight[i] for i in perm]


def test_batched_prefill_and_decode_on_any_slots_compute_what_one_sequence_alone_does():
    ids = SERVED.vocab.encode("The quick brown fox jumps")
    alone = KvDecoder(SERVED.model, slots=4)
    batch = KvDecoder(SERVED.model, slots=4)
    prompts = [ids[:6], ids[3:9], ids[10:16]]
    for slots in ([0, 1, 2], [3, 0, 2]):  # 0..B-1 decodes on a view of the cache, others on a gather
        together = batch.prefill_many(slots, prompts)
        for j, (slot, prompt) in enumerate(zip(slots, prompts)):
            torch.testing.assert_close(together[j], alone.prefill(slot, prompt), atol=1e-5, rtol=1e-5)
        tokens, positions = [ids[7], ids[1], ids[4]], [6, 6, 6]
        for _ in range(5):
            got = batch.decode(slots, tokens, positions)
            for j, slot in enumerate(slots):
                want = alone.decode([slot], [tokens[j]], [positions[j]])[0]
                torch.testing.assert_close(got[j], want, atol=1e-5, rtol=1e-5)
            tokens = [int(t) for t in got.argmax(dim=-1)]
            positions = [p + 1 for p in positions]
        full = SERVED.model(torch.tensor([prompts[0] + [ids[7]]]))[0, -1]  # and the training forward
        torch.testing.assert_close(alone.decode([slots[0]], [ids[7]], [6])[0], full, atol=1e-4, rtol=1e-4)


def test_a_non_streamed_generation_ends_with_the_streamed_text_in_one_delta():
    async def main() -> None:
        eng = ReplicaEngine(SERVED, EngineConfig(batch_size_max=8, queue_depth_max=16))
        loop = asyncio.create_task(eng.run())
        prompt = SERVED.vocab.encode("The ")
        try:
            for params in (SamplingParams(max_tokens=40, temperature=0.9, seed=5),
                           SamplingParams(max_tokens=40, temperature=0.9, seed=5, stop=("e ", "th"))):
                streamed = eng.submit(prompt, params)
                whole = eng.submit(prompt, params, streamed=False)
                text, deltas = "", 0
                while True:
                    d = await asyncio.wait_for(streamed.out.get(), 30)
                    text, deltas = text + d.text, deltas + 1
                    if d.finish_reason:
                        break
                last = await asyncio.wait_for(whole.out.get(), 30)
                assert last.finish_reason == d.finish_reason and last.text == text and whole.out.empty()
                assert deltas > 1 and whole.new_tokens == streamed.new_tokens
            assert eng.free_slots == 8
        finally:
            loop.cancel()

    asyncio.run(main())


def test_serving_falls_back_to_asyncio_and_h11_without_uvloop_and_says_so(monkeypatch, capsys):
    async def loop_kind() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert asgi_server.run(loop_kind(), "asyncio").startswith("asyncio")
    assert asgi_server.http_impl("asyncio") == "h11"
    if asgi_server.has_fast_pair():
        assert asgi_server.run(loop_kind(), "auto").startswith("uvloop")
        assert asgi_server.http_impl("auto").__name__ == "CoalescingHttpToolsProtocol"
    monkeypatch.setattr(asgi_server, "has_fast_pair", lambda: False)
    assert asgi_server.run(loop_kind(), "auto", "phalanx replica").startswith("asyncio")
    assert asgi_server.http_impl("auto") == "h11"
    assert "uvloop/httptools not installed: serving on asyncio + h11" in capsys.readouterr().err


class _RecordingTransport:
    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.sent.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


def test_writes_of_one_loop_iteration_leave_in_one_send_in_order_and_before_close():
    async def main() -> None:
        real = _RecordingTransport()
        t = asgi_server.CoalescingTransport(real, asyncio.get_running_loop())  # type: ignore[arg-type]
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b"body")
        assert real.sent == [] and t.get_write_buffer_size() == 23
        await asyncio.sleep(0)  # the end of the iteration
        assert real.sent == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
        t.write(b"last")
        t.close()  # flushed first
        assert real.sent[-1] == b"last" and real.closed and t.get_extra_info("peername") == "info:peername"
        big = asgi_server.WRITE_COALESCE_BYTES_MAX + 1
        real2 = _RecordingTransport()
        t2 = asgi_server.CoalescingTransport(real2, asyncio.get_running_loop())  # type: ignore[arg-type]
        t2.write(b"x" * big)  # past the bound: out at once (flow control sees it)
        assert real2.sent == [b"x" * big]
        await asyncio.sleep(0)
        assert len(real2.sent) == 1

    asyncio.run(main())


@pytest.mark.parametrize("event_loop", ["auto", "asyncio"])
def test_a_replica_serves_on_either_event_loop(token_file, event_loop):
    from phalanx.core.auth import read_token_file

    reps = spawn_replicas(1, ["--random-weights", "0", "--event-loop", event_loop], token_file)
    try:
        with httpx.Client(base_url=reps[0].url, auth=ClusterTokenAuth(read_token_file(token_file)), timeout=30) as c:
            r = c.post("/v1/completions", json={"model": "phalanx-charlm", "prompt": "The ", "max_tokens": 5, "seed": 1})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert httpx.get(reps[0].url + "/health", timeout=5).status_code == 401  # unsigned: refused on both
    finally:
        stop_replicas(reps)
