"""The replica's OpenAI API through the official openai client and raw HTTP (bad input included)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

MODEL = "phalanx-charlm"


def client(replica) -> openai.OpenAI:
    return openai.OpenAI(base_url=replica.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_openai_client_completion_streamed_equals_unstreamed_with_usage(replica):
    c = client(replica)
    full = c.completions.create(model=MODEL, prompt="def ", max_tokens=20, temperature=0.7, seed=3)
    assert full.choices[0].finish_reason == "length" and len(full.choices[0].text) == 20
    assert full.usage.completion_tokens == 20 and full.usage.prompt_tokens == 4
    chunks = list(c.completions.create(model=MODEL, prompt="def ", max_tokens=20, temperature=0.7, seed=3, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.choices[0].text
    assert chunks[-1].usage.total_tokens == 24


def test_openai_client_chat_streaming_and_models(replica):
    c = client(replica)
    assert [m.id for m in c.models.list().data] == [MODEL]
    msgs = [{"role": "user", "content": "hello"}]
    whole = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    parts = [ch.choices[0].delta.content or "" for ch in
             c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0, stream=True)]
    assert "".join(parts) == whole.choices[0].message.content and len(parts[0] + "".join(parts[1:])) == 12


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b'{"model": "phalanx-charlm", "prompt": 5}', 400, "prompt"),
    (b'{"model": "gpt-9", "prompt": "a"}', 404, None),
    (b'{"model": "phalanx-charlm", "prompt": ""}', 400, "prompt"),
    (b'{"model": "phalanx-charlm", "prompt": "' + b"a" * 80 + b'"}', 400, "prompt"),
    (b'{"model": "phalanx-charlm", "prompt": "a", "max_tokens": 500}', 400, "max_tokens"),
    (b'{"model": "phalanx-charlm", "prompt": "a", "temperature": 3}', 400, "temperature"),
    (b'{"model": "phalanx-charlm", "prompt": "a", "top_p": -1}', 400, "top_p"),
    (b'{"model": "phalanx-charlm", "prompt": "a", "max_tokens": "7"}', 400, "max_tokens"),
    (b'{"model": "phalanx-charlm", "prompt": "a", "stop": [1]}', 400, "stop"),
    (b'[1, 2]', 400, None),
])
def test_bad_input_gets_an_openai_error_object(replica, body, status, param):
    r = httpx.post(replica.url + "/v1/completions", content=body, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param


def test_body_over_the_limit_is_413_and_service_keeps_serving(replica):
    r = httpx.post(replica.url + "/v1/completions", content=b"x" * (2 << 20), timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert httpx.get(replica.url + "/health", timeout=5).json()["ok"]


def test_flood_past_capacity_gets_429_with_retry_after_and_slots_are_not_leaked(replica):
    async def main():
        async with httpx.AsyncClient(timeout=60) as h:
            body = {"model": MODEL, "prompt": "a", "max_tokens": 60, "temperature": 0}
            rs = await asyncio.gather(*(h.post(replica.url + "/v1/completions", json=body) for _ in range(40)))
            return [r for r in rs]
    rs = asyncio.run(main())
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes
    assert all(r.headers["retry-after"] for r in rs if r.status_code == 429)
    h = httpx.get(replica.url + "/health", timeout=5).json()
    assert h["batch_size"] == 0 and h["queue_depth"] == 0


def test_client_disconnect_mid_stream_frees_the_slot(replica):
    with httpx.stream("POST", replica.url + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": "a", "max_tokens": 60, "stream": True}) as r:
        for _ in r.iter_lines():
            break  # read one event and hang up
    for _ in range(100):
        if httpx.get(replica.url + "/health", timeout=5).json()["batch_size"] == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert httpx.get(replica.url + "/health", timeout=5).json()["batch_size"] == 0


def test_metrics_expose_latency_ttft_queue_and_batch(replica):
    text = httpx.get(replica.url + "/metrics", timeout=5).text
    for name in ("phalanx_serve_request_latency_seconds_bucket", "phalanx_serve_time_to_first_token_seconds_bucket",
                 "phalanx_serve_queue_depth", "phalanx_serve_batch_size", 'le="60.0"', 'le="0.001"'):
        assert name in text
