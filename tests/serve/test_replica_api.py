"""The replica's OpenAI API through the official openai client and raw HTTP (bad input included)."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import openai
import pytest

from phalanx.serve.request_auth import ClusterTokenAuth, sign_request

MODEL = "phalanx-charlm"


def client(replica) -> openai.OpenAI:
    return openai.OpenAI(base_url=replica.url + "/v1", api_key="unused", max_retries=0, timeout=30,
                         http_client=replica.client())


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
    r = replica.client().post(replica.url + "/v1/completions", content=body, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param


def test_body_over_the_limit_is_413_and_service_keeps_serving(replica):
    r = replica.client().post(replica.url + "/v1/completions", content=b"x" * (2 << 20), timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert replica.client().get(replica.url + "/health", timeout=5).json()["ok"]


def test_flood_past_capacity_gets_429_with_retry_after_and_slots_are_not_leaked(replica):
    async def main():
        async with httpx.AsyncClient(timeout=60, auth=ClusterTokenAuth(replica.token)) as h:
            body = {"model": MODEL, "prompt": "a", "max_tokens": 60, "temperature": 0}
            rs = await asyncio.gather(*(h.post(replica.url + "/v1/completions", json=body) for _ in range(40)))
            return [r for r in rs]
    rs = asyncio.run(main())
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes
    assert all(r.headers["retry-after"] for r in rs if r.status_code == 429)
    h = replica.client().get(replica.url + "/health", timeout=5).json()
    assert h["batch_size"] == 0 and h["queue_depth"] == 0


def test_client_disconnect_mid_stream_frees_the_slot(replica):
    with replica.client().stream("POST", replica.url + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": "a", "max_tokens": 60, "stream": True}) as r:
        for _ in r.iter_lines():
            break  # read one event and hang up
    for _ in range(100):
        if replica.client().get(replica.url + "/health", timeout=5).json()["batch_size"] == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert replica.client().get(replica.url + "/health", timeout=5).json()["batch_size"] == 0


def test_metrics_expose_latency_ttft_queue_and_batch(replica):
    text = replica.client().get(replica.url + "/metrics", timeout=5).text
    for name in ("phalanx_serve_request_latency_seconds_bucket", "phalanx_serve_time_to_first_token_seconds_bucket",
                 "phalanx_serve_queue_depth", "phalanx_serve_batch_size", 'le="60.0"', 'le="0.001"'):
        assert name in text


def test_replica_refuses_unsigned_requests_with_401_and_keeps_serving(replica):
    for path in ("/v1/completions", "/health", "/v1/models"):
        r = httpx.post(replica.url + path, json={"model": MODEL, "prompt": "a"}, timeout=10) if "compl" in path \
            else httpx.get(replica.url + path, timeout=10)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "missing_cluster_token"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=replica.url + "/v1", api_key="sk-anything", max_retries=0, timeout=10).completions.create(
            model=MODEL, prompt="a", max_tokens=2)
    assert replica.client().get(replica.url + "/health", timeout=5).json()["ok"]


def test_replica_refuses_a_wrong_token_an_altered_body_and_a_replay_with_403(replica):
    wrong = httpx.post(replica.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2},
                       auth=ClusterTokenAuth(b"x" * 32), timeout=10)
    assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "invalid_cluster_token"
    body = b'{"model": "phalanx-charlm", "prompt": "ab", "max_tokens": 2}'
    header = sign_request(replica.token, b"POST", b"/v1/completions", body, time.time(), os.urandom(16))
    with httpx.Client(timeout=10) as h:
        ok = h.post(replica.url + "/v1/completions", content=body, headers={"x-phalanx-auth": header})
        assert ok.status_code == 200, ok.text
        replayed = h.post(replica.url + "/v1/completions", content=body, headers={"x-phalanx-auth": header})
        assert replayed.status_code == 403 and "replayed" in replayed.json()["error"]["message"]
        fresh = sign_request(replica.token, b"POST", b"/v1/completions", body, time.time(), os.urandom(16))
        altered = h.post(replica.url + "/v1/completions", content=body.replace(b"ab", b"zz"),
                         headers={"x-phalanx-auth": fresh})
        assert altered.status_code == 403 and "does not match" in altered.json()["error"]["message"]
        stale = sign_request(replica.token, b"POST", b"/v1/completions", body, time.time() - 120, os.urandom(16))
        assert h.post(replica.url + "/v1/completions", content=body, headers={"x-phalanx-auth": stale}).status_code == 403
        other_path = sign_request(replica.token, b"POST", b"/v1/chat/completions", body, time.time(), os.urandom(16))
        altered = h.post(replica.url + "/v1/completions", content=body, headers={"x-phalanx-auth": other_path})
        assert altered.status_code == 403 and "does not match" in altered.json()["error"]["message"]
