"""The router's HTTP front: OpenAI-compatible routes over ``Router`` (admission, seeds, streams).

The completion routes are plain ASGI handlers, and ``RouterAsgi`` sends ``POST /v1/completions`` and
``POST /v1/chat/completions`` to them directly, around Starlette's middleware stack, routing and
Request/Response objects, and the 200 answer goes out as one start and one body message with its headers built
once: the router's CPU per request is latency added to every answer (docs/SERVING.md, "Session 14"). Everything else (other routes, methods, 404s,
the admin routes' signature check, lifespan) goes through the Starlette app, which lists the same handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.middleware import Middleware
from starlette.routing import Route

from phalanx.serve.errors import BadRequest, Overloaded, ServeError, UnknownModel
from phalanx.serve.replica_app import BODY_BYTES_MAX, BodyTooLarge, error_response, read_json_body, serve_error_response
from phalanx.serve.request_auth import Asgi, ClusterTokenOnAdmin, Receive, RequireApiKey, Scope, Send
from phalanx.serve.rollout import RolloutBusy, roll_out
from phalanx.serve.stream_relay import open_stream, relay_stream
from phalanx.serve.router import VERSION_HEADER, AttemptFailed, Router, VersionHeldBack
from phalanx.serve.versions import SESSION_HEADER, session_of
from phalanx.serve.routing_policy import backoff_s


COMPLETIONS_PATH, CHAT_PATH = "/v1/completions", "/v1/chat/completions"
SESSION_HEADER_BYTES = SESSION_HEADER.encode()
# msgspec's untyped decoder: the same dicts, lists and scalars as json.loads, ~7x cheaper on a request body
# (docs/SERVING.md, "Session 15"); its DecodeError is a ValueError. UTF-8 only (json.loads also sniffs UTF-16/32).
decode_json = msgspec.json.Decoder().decode


def header_value(scope: Scope, name: bytes) -> str | None:
    """The first header ``name`` (lower case) of an ASGI request, decoded as latin-1."""
    for k, v in scope["headers"]:
        if k == name:
            return bytes(v).decode("latin-1")
    return None


async def read_body(scope: Scope, receive: Receive, body_bytes_max: int = BODY_BYTES_MAX) -> bytes | None:
    """The request body from ASGI ``receive`` (``read_json_body``'s limits); None when the client disconnected."""
    declared = header_value(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > body_bytes_max:
        raise BodyTooLarge()
    chunks, size = [], 0
    while True:  # bounded by body_bytes_max
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > body_bytes_max:
            raise BodyTooLarge()
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class RouterHttp:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.cfg = router.cfg
        # labelled histogram children looked up once (labels() takes a lock and builds a key per call)
        self._latency = {p: router.metrics.latency.labels(p) for p in (COMPLETIONS_PATH, CHAT_PATH)}

    async def complete(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/completions`` and ``POST /v1/chat/completions`` (plain ASGI: the hot path). A unary 200 is
        the replica's bytes in one ``http.response.start`` and one body (uvicorn coalesces them into one send)."""
        path = scope["path"]
        t0 = time.monotonic()
        try:
            raw = await read_body(scope, receive)
            if raw is None:
                return  # the client left before its request arrived: nobody to answer
            try:
                body = decode_json(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise BadRequest(f"request body is not valid JSON ({e})") from e
            self._admit(body)
        except ServeError as e:
            await serve_error_response(e)(scope, receive, send)
            return
        session = session_of(body, header_value(scope, SESSION_HEADER_BYTES))
        if body.get("seed") is None:
            body["seed"] = self.router.rng.randrange(2**31)  # fixed here so a retry or a resumption samples alike
        self.router.active += 1
        self.router.requests_total += 1
        if body.get("stream") is True:
            response = await self._stream(path, body, path == CHAT_PATH, t0, session)
            await response(scope, receive, send)
            return
        try:
            status, payload, version = await self.router.unary(path, body, session)
        finally:
            self.router.active -= 1
        if status != 200:
            await JSONResponse(payload, status_code=status,
                               headers={"Retry-After": "1"} if status == 503 else None)(scope, receive, send)
            return
        self._latency[path].observe(time.monotonic() - t0)
        self.router.history.add(time.monotonic() - t0)
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
            (b"x-phalanx-model-version", version.encode("latin-1", "replace"))]})
        await send({"type": "http.response.body", "body": payload})  # the replica's bytes, not re-encoded

    def _admit(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        if body.get("model") != self.cfg.model_name:
            if not isinstance(body.get("model"), str):
                raise BadRequest("'model' is required and must be a string", param="model")
            raise UnknownModel(f"model '{body['model']}' does not exist; this server serves '{self.cfg.model_name}'")
        if self.router.active >= self.cfg.active_requests_max:
            self.router.metrics.rejected.inc()
            raise Overloaded(f"{self.router.active} requests in flight (limit {self.cfg.active_requests_max}); retry shortly")

    async def _stream(self, path: str, body: dict[str, Any], chat: bool, t0: float, session: str | None) -> Response:
        first = None
        for attempt in range(self.cfg.attempts_max):
            try:
                first = await open_stream(self.router, path, body, frozenset(), session)
            except VersionHeldBack as e:
                self.router.active -= 1
                return error_response(503, f"{e}; retry shortly", "server_error", "version_unavailable",
                                      headers={"Retry-After": "1"})
            except AttemptFailed:
                await asyncio.sleep(backoff_s(attempt, self.router.rng) + 0.02)
                continue
            if first[1].status_code == 200:
                break
            status, r = first[1].status_code, first[0]
            raw = await first[1].aread()
            await first[1].aclose()
            r.stats.outstanding -= 1
            first = None
            if 400 <= status < 500 and status != 429:  # the request itself is wrong: answer, do not retry
                self.router.active -= 1
                try:
                    return JSONResponse(json.loads(raw), status_code=status)
                except ValueError:
                    return error_response(status, "replica rejected the request", "invalid_request_error", "rejected")
        if first is None:
            self.router.active -= 1
            return error_response(503, "no replica could serve the request", "server_error", "replicas_unavailable",
                                  headers={"Retry-After": "1"})
        version = first[1].headers.get(VERSION_HEADER) or first[0].version
        self.router.observe_version(session, version)

        async def body_iter() -> AsyncIterator[bytes]:
            try:
                async for b in relay_stream(self.router, path, body, first, chat, t0):
                    yield b
            finally:
                self.router.active -= 1

        return StreamingResponse(body_iter(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Phalanx-Model-Version": version})

    async def models(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "phalanx"}]})

    async def health(self, _: Request) -> Response:
        return JSONResponse({"ok": True, "consistency": self.cfg.consistency.value,
                             "replicas": {rid: {"healthy": r.stats.healthy, "outstanding": r.stats.outstanding,
                                                "ewma_latency_s": round(r.stats.ewma_latency_s, 6), "version": r.version,
                                                "version_rank": self.router.book.rank(r.version),
                                                "admitting": r.admitting, "url": r.url}
                                                      for rid, r in self.router.replicas.items()},
                             "events": self.router.events[-20:]})

    async def ready(self, _: Request) -> Response:
        ok = any(r.stats.healthy for r in self.router.replicas.values())
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def metrics_route(self, _: Request) -> Response:
        for rid, r in self.router.replicas.items():
            self.router.metrics.outstanding.labels(rid).set(r.stats.outstanding)
        return Response(generate_latest(self.router.metrics.registry), media_type="text/plain; version=0.0.4")

    async def rollout(self, request: Request) -> Response:
        """``phalanx serve rollout``: swap every replica to a checkpoint, one at a time (admin: signed with
        the cluster token). Answers when done, with what happened to each replica."""
        try:
            body = await read_json_body(request)
            if not isinstance(body, dict) or not isinstance(body.get("checkpoint"), str) or not body["checkpoint"]:
                raise BadRequest("body must be {\"checkpoint\": CHECKPOINT_OR_RUN_DIR}", param="checkpoint")
        except ServeError as e:
            return serve_error_response(e)
        try:
            report = await roll_out(self.router, body["checkpoint"], log=lambda m: print(m, flush=True))
        except RolloutBusy as e:
            return error_response(409, str(e), "invalid_request_error", "rollout_running")
        return JSONResponse(report, status_code=200 if report["ok"] else 422)

    async def join(self, request: Request) -> Response:
        """``phalanx serve replica --join``: a replica on another machine asks to be routed to (admin:
        signed with the cluster token); it is admitted once its health polls succeed."""
        try:
            body = await read_json_body(request)
            rid, url = (body.get("replica_id"), body.get("url")) if isinstance(body, dict) else (None, None)
            if not isinstance(rid, str) or not rid or len(rid) > 64 or not rid.replace("-", "").replace("_", "").isalnum():
                raise BadRequest("'replica_id' must be 1 to 64 letters, digits, '-' or '_'", param="replica_id")
            if not isinstance(url, str) or not url.startswith("http://") or len(url) > 256:
                raise BadRequest("'url' must be http://HOST:PORT", param="url")
        except ServeError as e:
            return serve_error_response(e)
        if not self.router.add_replica(rid, url.rstrip("/")):
            return error_response(409, f"replica id {rid!r} is already a member at another URL", "invalid_request_error",
                                  "replica_exists", "replica_id")
        return JSONResponse({"joined": rid, "members": sorted(self.router.replicas)})

    async def not_found(self, request: Request, exc: Exception) -> Response:
        return error_response(404, f"no route {request.method} {request.url.path}", "invalid_request_error", "not_found")

    @contextlib.asynccontextmanager
    async def lifespan(self, _: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(self.router.watch_membership())
        try:
            yield
        finally:
            task.cancel()
            await self.router.client.aclose()
            self.router.close_connections()



class AsgiEndpoint:
    """A plain ASGI handler as a Starlette route (a bound method would be wrapped in Request/Response)."""

    def __init__(self, handler: Asgi) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handler(scope, receive, send)


class RouterAsgi:
    """The router's ASGI entry: ``POST`` to a completion route goes straight to ``RouterHttp.complete``, the
    rest to the Starlette app. Wrapped in ``RequireApiKey`` when an API key is set, so both paths check it."""

    FAST_PATHS = frozenset({COMPLETIONS_PATH, CHAT_PATH})

    def __init__(self, http: RouterHttp, app: Starlette) -> None:
        self.http, self.app = http, app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.FAST_PATHS:
            await self.http.complete(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def build_router_app(router: Router, api_key: str | None = None) -> Asgi:
    """The public app; with ``api_key``, /v1/ routes demand ``Authorization: Bearer <api_key>``. The admin
    routes under /phalanx/ (rollout, join) demand a request signed with the cluster token, as replicas do."""
    h = RouterHttp(router)
    complete = AsgiEndpoint(h.complete)
    app = Starlette(middleware=[Middleware(ClusterTokenOnAdmin, token=router.token, body_bytes_max=1 << 20)], routes=[
        Route("/phalanx/rollout", h.rollout, methods=["POST"]),
        Route("/phalanx/join", h.join, methods=["POST"]),
        Route(COMPLETIONS_PATH, complete, methods=["POST"]),
        Route(CHAT_PATH, complete, methods=["POST"]),
        Route("/v1/models", h.models, methods=["GET"]),
        Route("/health", h.health, methods=["GET"]),
        Route("/ready", h.ready, methods=["GET"]),
        Route("/metrics", h.metrics_route, methods=["GET"]),
    ], exception_handlers={404: h.not_found}, lifespan=h.lifespan)
    front = RouterAsgi(h, app)
    return RequireApiKey(front, api_key) if api_key else front
