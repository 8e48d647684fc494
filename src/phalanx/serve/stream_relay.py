"""Streams through the router: open one on a replica, relay its SSE chunks to the client, and when the
replica dies, stalls or is voted out mid-stream, resume it elsewhere: prompt + text streamed so far
(``phalanx_resume_text``, same seed) on a replica serving the same version, writing the same SSE
stream. The client sees one uninterrupted stream, identical to a fault-free run."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx

from phalanx.serve.router import VERSION_HEADER, AttemptFailed, ReplicaState, Router
from phalanx.serve.routing_policy import backoff_s

STREAM_TRIES_MAX = 1024  # the relay loop's hard bound (tries without progress stop it far sooner: attempts_max + 2)


async def open_stream(router: Router, path: str, body: dict[str, Any], exclude: frozenset[str], session: str | None = None,
                      pinned: str | None = None) -> tuple[ReplicaState, httpx.Response]:
    r = await router.choose_waiting(exclude, session, pinned)
    r.stats.outstanding += 1
    try:
        req = router.client.build_request("POST", r.url + path, json=body, timeout=httpx.Timeout(
            router.cfg.request_timeout_s, connect=0.5, read=router.cfg.stall_s * 2))
        resp = await asyncio.wait_for(router.client.send(req, stream=True), router.cfg.stall_s * 2)
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
        r.stats.outstanding -= 1
        router.note_failure(r, e)
        raise AttemptFailed(f"{r.stats.replica_id}: {type(e).__name__}") from e
    return r, resp

async def relay_stream(router: Router, path: str, body: dict[str, Any], first: tuple[ReplicaState, httpx.Response],
                 chat: bool, t0: float) -> AsyncIterator[bytes]:
    rid, created = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time())
    text = ""
    sent_any = False
    current: tuple[ReplicaState, httpx.Response] | None = first
    tried = {first[0].stats.replica_id}
    pinned = first[1].headers.get(VERSION_HEADER) or first[0].version  # a resumed stream stays on these weights
    finished = False
    base = 0  # characters streamed before the current replica took over
    opened_s = t0  # when the current replica's attempt was opened
    moved = False  # moved once off an ejected replica before its first token (it will not move again)
    fruitless = 0  # tries in a row that relayed no token: only those spend the budget (a stream whose replica
    # flaps on a starved box keeps its tries while it makes progress; its tokens, max_tokens, bound the rest)
    try:
        for _ in range(STREAM_TRIES_MAX):
            if fruitless >= router.cfg.attempts_max + 2:
                break
            if current is None:
                base, opened_s = len(text), time.monotonic()
                current = await _reopen(router, path, body, text, tried, pinned)
                if current is None:
                    fruitless += 1
                    await asyncio.sleep(backoff_s(fruitless, router.rng) + 0.05)
                    continue
            r, resp = current
            ahead, tokens_here = max(0, r.stats.outstanding - 1), 0  # requests it had besides this one
            try:
                if resp.status_code != 200:
                    raise AttemptFailed(f"HTTP {resp.status_code}")
                async for chunk in _relay(router, r, resp, None if sent_any else (opened_s, moved)):
                    if chunk is None:
                        # a finished stream teaches the EWMA its time here per typical-size request (a long
                        # stream on a healthy replica is not slow; a straggler's streams are, token for token)
                        r.stats.observe(time.monotonic() - opened_s, router.cfg.policy.ewma_alpha, ahead,
                                        router.sizes.size(tokens_here))
                        finished = True
                        break
                    tokens_here += _tokens(chunk)
                    out = _rewrite(router, chunk, rid, created, sent_any, base)
                    for c in chunk.get("choices") or []:
                        text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                    if not sent_any:
                        router.metrics.ttft.labels(path).observe(time.monotonic() - t0)
                    sent_any = True
                    yield b"data: " + json.dumps(out).encode() + b"\n\n"
            except (AttemptFailed, httpx.HTTPError, ValueError) as e:
                if isinstance(e, AttemptFailed) and e.moved:
                    moved = True  # off an ejected replica, once; not the replica's failure
                else:
                    router.note_failure(r, e)
            finally:
                r.stats.outstanding -= 1
                await resp.aclose()
                current = None
            fruitless = 0 if tokens_here else fruitless + 1
            if finished:
                break
        if finished:
            yield b"data: [DONE]\n\n"
            router.metrics.latency.labels(path).observe(time.monotonic() - t0)
            router.history.add(time.monotonic() - t0)
        else:
            err = {"error": {"message": "stream could not be completed on any replica", "type": "server_error",
                             "param": None, "code": "replicas_unavailable"}}
            yield b"data: " + json.dumps(err).encode() + b"\n\n"
    finally:
        if current is not None:
            current[0].stats.outstanding -= 1
            await current[1].aclose()

async def _reopen(router: Router, path: str, body: dict[str, Any], text: str, tried: set[str], pinned: str | None
                 ) -> tuple[ReplicaState, httpx.Response] | None:
    """The stream again on another replica of its version: prompt + ``text`` streamed so far, same seed."""
    try:
        current = await open_stream(router, path, dict(body, phalanx_resume_text=text), frozenset(tried), pinned=pinned)
    except AttemptFailed:
        tried.clear()
        return None
    tried.add(current[0].stats.replica_id)
    router.metrics.resumptions.inc()
    return current


async def _relay(router: Router, r: ReplicaState, resp: httpx.Response, held: tuple[float, bool] | None = None
                 ) -> AsyncIterator[dict[str, Any] | None]:
    """Chunks from one replica; raises AttemptFailed when it stalls or is voted out mid-stream.

    ``held`` (opened at, moved before): the stream has sent the client nothing yet, so until its first chunk an
    ejection of this replica may move it (``Router.hold``; AttemptFailed with ``moved``). A stream that has
    sent tokens stays: it holds a running slot, not a place in the queue, and moving it would re-prefill its
    whole text elsewhere (the stall and membership rules still resume it if the replica stops)."""
    key = None if held is None else router.hold(r, *held)
    lines = resp.aiter_lines()
    pending: asyncio.Future[str] | None = None
    stalled_since = time.monotonic()
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(lines.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=0.05)
            if not done:
                # a straggler's steps are slow, not stalled: the limit scales with its own step time
                stall_s = max(router.cfg.stall_s, router.cfg.progress_steps_max * r.step_time_s)
                if not r.stats.healthy or time.monotonic() - stalled_since > stall_s:
                    raise AttemptFailed(f"{r.stats.replica_id} stalled or left rotation mid-stream")
                if key is not None and key in r.move_keys:
                    raise AttemptFailed(f"{r.stats.replica_id} was ejected; the stream moves", moved=True)
                continue
            try:
                line = pending.result()
            except StopAsyncIteration:
                raise AttemptFailed(f"{r.stats.replica_id} closed the stream early") from None
            pending = None
            stalled_since = time.monotonic()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                if key is not None:
                    router.release(r, key)
                    key = None
                yield None
                return
            chunk = json.loads(data)
            if not isinstance(chunk, dict) or "error" in chunk:
                raise AttemptFailed(f"{r.stats.replica_id} sent an error or garbage mid-stream")
            if key is not None:  # output: no longer movable
                router.release(r, key)
                key = None
            yield chunk
    finally:
        if key is not None:
            router.release(r, key)
        if pending is not None:
            pending.cancel()

def _tokens(chunk: dict[str, Any]) -> int:
    """Tokens a replica's chunk carries (its ``phalanx_token_ids``; else one a chunk with text)."""
    ids = chunk.get("phalanx_token_ids")
    if isinstance(ids, list):
        return len(ids)
    return sum(1 for c in chunk.get("choices") or [] if c.get("text") or (c.get("delta") or {}).get("content"))


def _rewrite(router: Router, chunk: dict[str, Any], rid: str, created: int, sent_any: bool, resumed_chars: int) -> dict[str, Any]:
    out = dict(chunk, id=rid, created=created, model=router.cfg.model_name)
    out.pop("phalanx_token_ids", None)
    if sent_any:
        for c in out.get("choices") or []:
            if isinstance(c.get("delta"), dict):
                c["delta"].pop("role", None)
    if isinstance(out.get("usage"), dict) and resumed_chars:
        u = dict(out["usage"])
        u["completion_tokens"] = u.get("completion_tokens", 0) + resumed_chars
        u["total_tokens"] = u.get("prompt_tokens", 0) + u["completion_tokens"]
        out["usage"] = u
    return out
