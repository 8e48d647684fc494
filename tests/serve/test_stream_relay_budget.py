"""The stream relay's retry budget counts only tries that relay nothing: a stream interrupted again and again
while it makes progress (a flapping replica on a starved box) completes, one that never gets a token stops
after attempts_max + 2 tries. Fake replicas behind httpx's MockTransport: no processes, no sockets."""

from __future__ import annotations

import asyncio
import json

import httpx

from phalanx.serve.router import VERSION_HEADER, Router
from phalanx.serve.stream_relay import open_stream, relay_stream

PATH = "/v1/completions"
BODY = {"model": "phalanx-charlm", "prompt": "The ", "max_tokens": 16, "seed": 1, "stream": True}


def _chunk(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": None}],
                                   "phalanx_token_ids": [1]}).encode() + b"\n\n"


def _router(handler) -> Router:
    router = Router({"a": "http://127.0.0.1:9", "b": "http://127.0.0.1:10"})
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    for r in router.replicas.values():
        r.stats.healthy, r.version = True, "v1"
    return router


def _run(router: Router) -> list[dict]:
    async def go() -> list[dict]:
        first = await open_stream(router, PATH, dict(BODY), frozenset())
        out = [json.loads(raw[6:]) async for raw in relay_stream(router, PATH, dict(BODY), first, False, 0.0)
               if raw != b"data: [DONE]\n\n"]
        await router.client.aclose()
        return out

    return asyncio.run(go())


def test_a_stream_interrupted_after_every_token_still_completes():
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        resumed = json.loads(request.content).get("phalanx_resume_text", "")
        calls.append(resumed)
        done = len(resumed) >= 9  # nine interruptions, each after one token, then the rest of the stream
        body = _chunk("x") + (b"data: [DONE]\n\n" if done else b"")  # no [DONE]: the replica closed early
        return httpx.Response(200, headers={VERSION_HEADER: "v1"}, content=body)

    chunks = _run(_router(handler))
    assert "error" not in chunks[-1], chunks[-1]  # before: ended after 6 tries (attempts_max + 2) in total
    assert "".join(c["choices"][0]["text"] for c in chunks) == "x" * 10
    assert calls == ["x" * i for i in range(10)]  # each try resumed from the text streamed so far


def test_a_stream_that_never_gets_a_token_stops_after_attempts_max_plus_two_tries():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.host)
        return httpx.Response(200, headers={VERSION_HEADER: "v1"}, content=b"")  # closes before any token

    router = _router(handler)
    chunks = _run(router)
    assert chunks[-1]["error"]["code"] == "replicas_unavailable"
    assert len(calls) == router.cfg.attempts_max + 2
