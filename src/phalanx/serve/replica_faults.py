"""Faults a replica suffers from the inside, switched on by the fault driver over the authenticated
``POST /phalanx/fault`` route: straggler (every decode step ``factor`` x slower), hang (the decode
loop stands still while heartbeats still answer), and the network kinds at the replica's HTTP edge:

- ``latency``: every request waits ``mean_ms`` (plus uniform ``jitter_ms``) before it is read and
  again before its response starts (one round trip);
- ``loss``: HTTP runs on TCP, so a lost segment is retransmitted, not lost: each request draws
  losses with ``probability`` and pays 200 ms (Linux's minimum RTO), doubling, per lost segment;
- ``partition``: nothing in or out for ``for_s``: new requests and every chunk of responses already
  streaming wait until the partition heals (the router sees heartbeats time out).

``kill`` and ``freeze`` are signals sent by the driver (``serve.fault_driver``), not routes here.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

from phalanx.serve.engine import ReplicaEngine
from phalanx.serve.errors import BadRequest
from phalanx.serve.request_auth import Asgi, Receive, Scope, Send

RTO_MIN_S = 0.2
LOSSES_MAX = 6  # TCP gives up long before; bounds the wait at 12.6 s


@dataclass
class EdgeFaults:
    latency_s: float = 0.0
    jitter_s: float = 0.0
    latency_until_s: float = 0.0
    loss_probability: float = 0.0
    loss_until_s: float = 0.0
    partition_until_s: float = 0.0


def _until(now_s: float, for_s: Any) -> float:
    if for_s is None:
        return float("inf")
    if not isinstance(for_s, (int, float)) or not 0 < for_s <= 86_400:
        raise BadRequest("'for_s' must be a number of seconds in (0, 86400]", param="for_s")
    return now_s + float(for_s)


def _number(spec: dict[str, Any], key: str, lo: float, hi: float, default: float | None = None) -> float:
    v = spec.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise BadRequest(f"'{key}' must be a number in [{lo:g}, {hi:g}]", param=key)
    return float(v)


def apply_fault(spec: Any, engine: ReplicaEngine, edge: EdgeFaults, now_s: float) -> str:
    """Switch one fault on (or ``clear`` them all); returns what was done, for the driver's log."""
    if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str):
        raise BadRequest("a fault is a JSON object with a 'kind'", param="kind")
    kind = spec["kind"]
    if kind == "straggler":
        engine.slowdown_factor = _number(spec, "factor", 1.0, 1000.0)
        if spec.get("for_s") is not None:
            asyncio.get_running_loop().call_later(_until(0.0, spec["for_s"]), setattr, engine, "slowdown_factor", 1.0)
        return f"straggler x{engine.slowdown_factor:g}"
    if kind == "hang":
        engine.hung_until_s = _until(time.monotonic(), spec.get("for_s"))
        return f"hang for {spec.get('for_s')} s"
    if kind == "latency":
        edge.latency_s = _number(spec, "mean_ms", 0.0, 600_000.0) / 1000
        edge.jitter_s = _number(spec, "jitter_ms", 0.0, 600_000.0, 0.0) / 1000
        edge.latency_until_s = _until(now_s, spec.get("for_s"))
        return f"latency {edge.latency_s * 1000:g} ms"
    if kind == "loss":
        edge.loss_probability = _number(spec, "probability", 0.0, 1.0)
        edge.loss_until_s = _until(now_s, spec.get("for_s"))
        return f"loss p={edge.loss_probability:g}"
    if kind == "partition":
        edge.partition_until_s = _until(now_s, spec.get("for_s"))
        return f"partition for {spec.get('for_s')} s"
    if kind == "clear":
        engine.slowdown_factor, engine.hung_until_s = 1.0, 0.0
        edge.latency_until_s = edge.loss_until_s = edge.partition_until_s = 0.0
        return "cleared"
    raise BadRequest(f"fault kind '{kind}' cannot be applied inside a replica (kill and freeze are signals)",
                     param="kind")


def edge_delay_s(edge: EdgeFaults, now_s: float, rng: random.Random) -> float:
    """How long one request waits at the replica's edge now (pure but for the rng)."""
    wait = 0.0
    if now_s < edge.partition_until_s:
        wait += edge.partition_until_s - now_s
    if now_s < edge.latency_until_s:
        wait += edge.latency_s + rng.uniform(0.0, edge.jitter_s)
    if now_s < edge.loss_until_s:
        rto = RTO_MIN_S
        for _ in range(LOSSES_MAX):
            if rng.random() >= edge.loss_probability:
                break
            wait += rto
            rto *= 2
    return wait


class NetworkFaultEdge:
    """ASGI middleware: the replica's network as the fault plan says (outermost, before authentication)."""

    def __init__(self, app: Asgi, edge: EdgeFaults, seed: int = 0) -> None:
        self.app, self.edge, self.rng = app, edge, random.Random(seed)

    async def _hold(self) -> None:
        if time.monotonic() < self.edge.partition_until_s:
            await asyncio.sleep(min(self.edge.partition_until_s - time.monotonic(), 86_400.0))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] == "/phalanx/fault":  # the driver's own control route is not cut off
            await self.app(scope, receive, send)
            return
        delay = edge_delay_s(self.edge, time.monotonic(), self.rng)
        if delay > 0:
            await asyncio.sleep(delay)
        first = True

        async def faulty_send(msg: Any) -> None:
            nonlocal first
            await self._hold()  # a partition also stops chunks of streams already running
            if first and time.monotonic() < self.edge.latency_until_s:
                await asyncio.sleep(self.edge.latency_s)
            first = False
            await send(msg)

        await self.app(scope, receive, faulty_send)
