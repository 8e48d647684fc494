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
from phalanx.serve.request_auth import RequireApiKey
from phalanx.serve.router import AttemptFailed, Router
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
        if body.get("seed") is None:
            body["seed"] = self.router.rng.randrange(2**31)  # fixed here so a retry or a resumption samples alike
        self.router.active += 1
        self.router.requests_total += 1
        if body.get("stream") is True:
            return await self._stream(path, body, chat, t0)
        try:
            status, payload = await self.router.unary(path, body)
        finally:
            self.router.active -= 1
        if status == 200:
            self.router.metrics.latency.labels(path).observe(time.monotonic() - t0)
            self.router.history.add(time.monotonic() - t0)
        return JSONResponse(payload, status_code=status)

    async def _stream(self, path: str, body: dict[str, Any], chat: bool, t0: float) -> Response:
        first = None
        for attempt in range(self.cfg.attempts_max):
            try:
                first = await self.router.open_stream(path, body, frozenset())
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
            return error_response(503, "no replica could serve the request", "server_error", "replicas_unavailable")

        async def body_iter() -> AsyncIterator[bytes]:
            try:
                async for b in self.router.stream(path, body, first, chat, t0):
                    yield b
            finally:
                self.router.active -= 1

        return StreamingResponse(body_iter(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def models(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "phalanx"}]})

    async def health(self, _: Request) -> Response:
        return JSONResponse({"ok": True, "replicas": {rid: {"healthy": r.stats.healthy, "outstanding": r.stats.outstanding,
                                                            "ewma_latency_s": round(r.stats.ewma_latency_s, 6)}
                                                      for rid, r in self.router.replicas.items()},
                             "events": self.router.events[-20:]})

    async def ready(self, _: Request) -> Response:
        ok = any(r.stats.healthy for r in self.router.replicas.values())
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def metrics_route(self, _: Request) -> Response:
        for rid, r in self.router.replicas.items():
            self.router.metrics.outstanding.labels(rid).set(r.stats.outstanding)
        return Response(generate_latest(self.router.metrics.registry), media_type="text/plain; version=0.0.4")

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



def build_router_app(router: Router, api_key: str | None = None) -> Starlette:
    """The public app; with ``api_key``, /v1/ routes demand ``Authorization: Bearer <api_key>``."""
    h = RouterHttp(router)
    middleware = [Middleware(RequireApiKey, api_key=api_key)] if api_key else []
    return Starlette(middleware=middleware, routes=[
        Route("/v1/completions", h.completions, methods=["POST"]),
        Route("/v1/chat/completions", h.chat_completions, methods=["POST"]),
        Route("/v1/models", h.models, methods=["GET"]),
        Route("/health", h.health, methods=["GET"]),
        Route("/ready", h.ready, methods=["GET"]),
        Route("/metrics", h.metrics_route, methods=["GET"]),
    ], exception_handlers={404: h.not_found}, lifespan=h.lifespan)
