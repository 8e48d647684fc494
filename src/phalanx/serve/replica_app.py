"""The replica's OpenAI-compatible HTTP API (Starlette, served by uvicorn).

Every request ends in exactly one response: a completion, a stream that ends with ``[DONE]``, or
one OpenAI error object. A client that disconnects mid-stream cancels its generation, which
frees the KV-cache slot at the next decode step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.middleware import Middleware
from starlette.routing import Route

from phalanx.core.errors import PhalanxError
from phalanx.serve.engine import Delta, Generation, ReplicaEngine
from phalanx.serve.errors import BadRequest, ServeError
from phalanx.serve.openai_request import CompletionRequest, parse_completion
from phalanx.serve.replica_faults import EdgeFaults, NetworkFaultEdge, apply_fault
from phalanx.serve.request_auth import RequireClusterToken
from phalanx.serve.served_model import find_checkpoint, load_served_model

BODY_BYTES_MAX = 1 << 20
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DELTA_WAIT_S = 60.0  # a generation that makes no progress for this long is a broken invariant of the engine


def error_response(status: int, message: str, kind: str, code: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def serve_error_response(e: ServeError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 429 else None
    return error_response(e.status, str(e), e.kind, e.code, getattr(e, "param", None), headers)


class ReplicaMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.latency = Histogram("phalanx_serve_request_latency_seconds", "request latency", ["route"],
                                 buckets=LATENCY_BUCKETS_S, registry=r)
        self.ttft = Histogram("phalanx_serve_time_to_first_token_seconds", "time to first token", ["route"],
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.responses = Counter("phalanx_serve_responses", "responses by status", ["status"], registry=r)
        self.queue_depth = Gauge("phalanx_serve_queue_depth", "requests waiting for a batch slot", registry=r)
        self.batch_size = Gauge("phalanx_serve_batch_size", "sequences in the running batch", registry=r)
        self.tokens = Gauge("phalanx_serve_tokens_generated", "tokens generated since start", registry=r)


async def read_json_body(request: Request, body_bytes_max: int = BODY_BYTES_MAX) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > body_bytes_max:
        raise BodyTooLarge()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > body_bytes_max:
            raise BodyTooLarge()
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON ({e})") from e


class BodyTooLarge(ServeError):
    status, code, kind = 413, "body_too_large", "invalid_request_error"

    def __init__(self) -> None:
        super().__init__(f"request body exceeds {BODY_BYTES_MAX} bytes")


class ReplicaHttp:
    def __init__(self, engine: ReplicaEngine, model_name: str) -> None:
        self.engine = engine
        self.edge = EdgeFaults()
        self.model_name = model_name
        self.metrics = ReplicaMetrics()
        self.device = str(engine.served.model.tok.weight.device)
        self.created = int(time.time())
        self.load_lock = asyncio.Lock()

    @property
    def version(self) -> str:
        return self.engine.served.version  # changes when a rollout swaps the weights

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def _complete(self, request: Request, chat: bool) -> Response:
        t0 = time.monotonic()
        route = "chat" if chat else "completions"
        try:
            body = await read_json_body(request)
            req = parse_completion(body, chat, self.model_name, self.engine.served.vocab, self.engine.context)
            gen = self.engine.submit(req.prompt_ids, req.params, self.engine.served.vocab.encode(req.resumed_text),
                                     streamed=req.stream)
        except ClientDisconnect:
            return Response(status_code=499)
        except ServeError as e:
            self.metrics.responses.labels(str(e.status)).inc()
            return serve_error_response(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if req.stream:
            return StreamingResponse(self._stream(gen, req, rid, route, t0), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Phalanx-Model-Version": self.version})
        text, finish = "", None
        try:
            waited_s, checked_s = 0.0, time.monotonic()
            while finish is None:
                if time.monotonic() - checked_s >= 0.25:  # also while tokens flow: a lost hedge frees its slot
                    checked_s = time.monotonic()
                    if await request.is_disconnected():
                        return Response(status_code=499)
                try:
                    d = await asyncio.wait_for(gen.out.get(), 0.25)
                except asyncio.TimeoutError:
                    waited_s += 0.25
                    if await request.is_disconnected():  # a hedge lost or the client left: free the slot
                        return Response(status_code=499)
                    if waited_s > DELTA_WAIT_S:
                        raise
                    continue
                if not text and d.text:
                    self.metrics.ttft.labels(route).observe(time.monotonic() - t0)
                text, finish = text + d.text, d.finish_reason
        finally:
            self.engine.cancel(gen)  # no-op when finished; frees the slot if this handler was cancelled
        self.metrics.latency.labels(route).observe(time.monotonic() - t0)
        self.metrics.responses.labels("200").inc()
        usage = _usage(req, gen)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": self.created,
                             "model": self.model_name, "system_fingerprint": self.version, "choices": [choice], "usage": usage},
                            headers={"X-Phalanx-Model-Version": self.version})

    async def _stream(self, gen: Generation, req: CompletionRequest, rid: str, route: str, t0: float) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if req.chat else "text_completion"
        first = True
        try:
            while True:
                async with asyncio.timeout(DELTA_WAIT_S):  # no task per token (wait_for makes one on 3.11)
                    d: Delta = await gen.out.get()
                if d.finish_reason == "cancelled":
                    return
                if d.text and first:
                    self.metrics.ttft.labels(route).observe(time.monotonic() - t0)
                if req.chat:
                    delta: dict[str, Any] = {"content": d.text}
                    if first:
                        delta["role"] = "assistant"
                    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": d.finish_reason}
                else:
                    choice = {"index": 0, "text": d.text, "finish_reason": d.finish_reason, "logprobs": None}
                first = False
                chunk: dict[str, Any] = {"id": rid, "object": obj, "created": self.created, "model": self.model_name,
                                         "system_fingerprint": self.version, "choices": [choice],
                                         "phalanx_token_ids": list(d.token_ids)}
                if req.include_usage:
                    chunk["usage"] = None
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                if d.finish_reason is not None:
                    break
            if req.include_usage:
                usage_chunk = {"id": rid, "object": obj, "created": self.created, "model": self.model_name, "choices": [],
                               "usage": _usage(req, gen)}
                yield b"data: " + json.dumps(usage_chunk).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
            self.metrics.latency.labels(route).observe(time.monotonic() - t0)
            self.metrics.responses.labels("200").inc()
        finally:
            self.engine.cancel(gen)  # client gone (generator closed) or done: the slot is freed either way

    async def models(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "phalanx", "version": self.version}]})

    async def health(self, _: Request) -> Response:
        return JSONResponse({"ok": not (self.engine.draining or self.engine.loading), "draining": self.engine.draining,
                             "loading": self.engine.loading, "version": self.version,
                             "steps": self.engine.steps, "step_time_s": round(self.engine.step_time_s, 6), "queue_depth": self.engine.queue_depth,
                             "batch_size": self.engine.batch_size})

    async def fault(self, request: Request) -> Response:
        """The fault driver switches a fault on (authenticated like every replica route)."""
        try:
            done = apply_fault(await read_json_body(request), self.engine, self.edge, time.monotonic())
        except ServeError as e:
            return serve_error_response(e)
        return JSONResponse({"applied": done})

    async def load(self, request: Request) -> Response:
        """A rollout swaps the weights (authenticated like every replica route): admission closes, the
        running generations finish (bounded), the checkpoint is read and verified (SHA-256, shapes,
        vocabulary) off the event loop, and only then replaces the old weights; on any error the old
        weights keep serving and the answer says why."""
        try:
            body = await read_json_body(request)
            if not isinstance(body, dict) or not isinstance(body.get("checkpoint"), str):
                raise BadRequest("body must be {\"checkpoint\": PATH, \"drain_timeout_s\": S}", param="checkpoint")
            drain_timeout_s = float(body.get("drain_timeout_s", 30.0))
        except (ServeError, TypeError, ValueError) as e:
            return serve_error_response(e if isinstance(e, ServeError) else BadRequest(str(e)))
        if self.load_lock.locked() or self.engine.draining:
            return error_response(409, "a load is already running or the replica is shutting down", "invalid_request_error",
                                  "busy")
        async with self.load_lock:
            self.engine.loading = True
            try:
                deadline_s = time.monotonic() + drain_timeout_s
                while not self.engine.is_idle and time.monotonic() < deadline_s:  # bounded by the deadline
                    await asyncio.sleep(0.01)
                if not self.engine.is_idle:
                    return error_response(409, f"still busy after {drain_timeout_s:g} s; weights unchanged",
                                          "invalid_request_error", "busy")
                before = self.version
                try:  # a run directory resolves to its latest committed checkpoint, named in the answer so the
                    # router loads that very one on the other replicas while training writes newer ones
                    ckpt = find_checkpoint(body["checkpoint"])
                    served = await asyncio.to_thread(load_served_model, ckpt, self.device)
                except (PhalanxError, KeyError, ValueError, RuntimeError, OSError) as e:  # the file's fault, not ours
                    return error_response(422, f"{e}; still serving {before}", "invalid_request_error", "bad_checkpoint",
                                          "checkpoint")
                self.engine.swap_model(served)
                return JSONResponse({"version": self.version, "previous": before, "checkpoint": str(ckpt)})
            finally:
                self.engine.loading = False

    async def ready(self, _: Request) -> Response:
        ok = self.engine.queue_depth < self.engine.cfg.queue_depth_max
        return JSONResponse({"ready": ok, "queue_depth": self.engine.queue_depth}, status_code=200 if ok else 503)

    async def metrics_route(self, _: Request) -> Response:
        self.metrics.queue_depth.set(self.engine.queue_depth)
        self.metrics.batch_size.set(self.engine.batch_size)
        self.metrics.tokens.set(self.engine.tokens_generated)
        return Response(generate_latest(self.metrics.registry), media_type="text/plain; version=0.0.4")

    async def not_found(self, request: Request, exc: Exception) -> Response:
        return error_response(404, f"no route {request.method} {request.url.path}", "invalid_request_error",
                              "not_found")

    async def bad_method(self, request: Request, exc: Exception) -> Response:
        return error_response(405, f"{request.method} not allowed on {request.url.path}", "invalid_request_error",
                              "method_not_allowed")

    @contextlib.asynccontextmanager
    async def lifespan(self, _: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(self.engine.run())
        try:
            yield
        finally:
            task.cancel()



def build_replica_app(engine: ReplicaEngine, model_name: str = "phalanx-charlm", token: bytes | None = None) -> Starlette:
    """The replica's app; with ``token``, every route demands a request signed with the cluster token
    (``replica_main`` always passes one), and the network fault edge sits outside it."""
    h = ReplicaHttp(engine, model_name)
    middleware = [Middleware(NetworkFaultEdge, edge=h.edge)]
    if token is not None:
        middleware.append(Middleware(RequireClusterToken, token=token, body_bytes_max=BODY_BYTES_MAX))
    return Starlette(middleware=middleware, routes=[
        Route("/phalanx/fault", h.fault, methods=["POST"]),
        Route("/phalanx/load", h.load, methods=["POST"]),
        Route("/v1/completions", h.completions, methods=["POST"]),
        Route("/v1/chat/completions", h.chat_completions, methods=["POST"]),
        Route("/v1/models", h.models, methods=["GET"]),
        Route("/health", h.health, methods=["GET"]),
        Route("/ready", h.ready, methods=["GET"]),
        Route("/metrics", h.metrics_route, methods=["GET"]),
    ], exception_handlers={404: h.not_found, 405: h.bad_method}, lifespan=h.lifespan)

def _usage(req: CompletionRequest, gen: Generation) -> dict[str, int]:
    completion = gen.new_tokens
    return {"prompt_tokens": len(req.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(req.prompt_ids) + completion}
