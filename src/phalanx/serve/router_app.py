"""The router's HTTP front: OpenAI-compatible routes over ``Router`` (admission, seeds, streams)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.middleware import Middleware
from starlette.routing import Route

from phalanx.serve.errors import BadRequest, Overloaded, ServeError, UnknownModel
from phalanx.serve.replica_app import error_response, read_json_body, serve_error_response
from phalanx.serve.request_auth import ClusterTokenOnAdmin, RequireApiKey
from phalanx.serve.rollout import RolloutBusy, roll_out
from phalanx.serve.stream_relay import open_stream, relay_stream
from phalanx.serve.router import VERSION_HEADER, AttemptFailed, Router, VersionHeldBack
from phalanx.serve.versions import SESSION_HEADER, session_of
from phalanx.serve.routing_policy import backoff_s


class RouterHttp:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.cfg = router.cfg

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "/v1/completions", chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, "/v1/chat/completions", chat=True)

    async def _complete(self, request: Request, path: str, chat: bool) -> Response:
        t0 = time.monotonic()
        try:
            body = await read_json_body(request)
            if not isinstance(body, dict):
                raise BadRequest("request body must be a JSON object")
            if body.get("model") != self.cfg.model_name:
                if not isinstance(body.get("model"), str):
                    raise BadRequest("'model' is required and must be a string", param="model")
                raise UnknownModel(f"model '{body['model']}' does not exist; this server serves '{self.cfg.model_name}'")
            if self.router.active >= self.cfg.active_requests_max:
                self.router.metrics.rejected.inc()
                raise Overloaded(f"{self.router.active} requests in flight (limit {self.cfg.active_requests_max}); retry shortly")
        except ServeError as e:
            return serve_error_response(e)
        session = session_of(body, request.headers.get(SESSION_HEADER))
        if body.get("seed") is None:
            body["seed"] = self.router.rng.randrange(2**31)  # fixed here so a retry or a resumption samples alike
        self.router.active += 1
        self.router.requests_total += 1
        if body.get("stream") is True:
            return await self._stream(path, body, chat, t0, session)
        try:
            status, payload, version = await self.router.unary(path, body, session)
        finally:
            self.router.active -= 1
        if status == 200:
            self.router.metrics.latency.labels(path).observe(time.monotonic() - t0)
            self.router.history.add(time.monotonic() - t0)
            return Response(payload, status_code=status, media_type="application/json",
                            headers={"X-Phalanx-Model-Version": version})  # the replica's bytes, not re-encoded
        return JSONResponse(payload, status_code=status, headers={"Retry-After": "1"} if status == 503 else None)

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



def build_router_app(router: Router, api_key: str | None = None) -> Starlette:
    """The public app; with ``api_key``, /v1/ routes demand ``Authorization: Bearer <api_key>``. The admin
    routes under /phalanx/ (rollout, join) demand a request signed with the cluster token, as replicas do."""
    h = RouterHttp(router)
    middleware = [Middleware(RequireApiKey, api_key=api_key)] if api_key else []
    middleware.append(Middleware(ClusterTokenOnAdmin, token=router.token, body_bytes_max=1 << 20))
    return Starlette(middleware=middleware, routes=[
        Route("/phalanx/rollout", h.rollout, methods=["POST"]),
        Route("/phalanx/join", h.join, methods=["POST"]),
        Route("/v1/completions", h.completions, methods=["POST"]),
        Route("/v1/chat/completions", h.chat_completions, methods=["POST"]),
        Route("/v1/models", h.models, methods=["GET"]),
        Route("/health", h.health, methods=["GET"]),
        Route("/ready", h.ready, methods=["GET"]),
        Route("/metrics", h.metrics_route, methods=["GET"]),
    ], exception_handlers={404: h.not_found}, lifespan=h.lifespan)
