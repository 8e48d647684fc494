"""Carries out a serving fault plan against real replica processes, on the plan's clock (``at_s``
from when the driver starts): ``kill`` is SIGKILL, ``freeze`` is SIGSTOP then SIGCONT after
``for_s``; the other kinds are switched on inside the replica over its authenticated
``POST /phalanx/fault`` route (see ``replica_faults``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from typing import Any, Protocol

import httpx

from phalanx.serve.request_auth import ClusterTokenAuth
from phalanx.serve.serving_faults import ServingFault


class _Replica(Protocol):
    @property
    def url(self) -> str: ...
    @property
    def proc(self) -> Any: ...


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


async def apply_one(f: ServingFault, replica: _Replica, client: httpx.AsyncClient) -> str:
    pid = replica.proc.pid
    if f.kind == "kill":
        _signal(pid, signal.SIGKILL)
        if f.restart and hasattr(replica, "restart"):
            return f"SIGKILL r{f.replica} (pid {pid}); restarting on port {replica.port}"
        return f"SIGKILL r{f.replica} (pid {pid})"
    if f.kind == "freeze":
        _signal(pid, signal.SIGSTOP)
        asyncio.get_running_loop().call_later(f.for_s or 0.0, _signal, pid, signal.SIGCONT)
        return f"SIGSTOP r{f.replica} for {f.for_s} s"
    spec: dict[str, Any] = {"kind": f.kind, "for_s": f.for_s, **dict(f.params)}
    if f.kind == "straggler":
        spec["factor"] = f.factor
    resp = await client.post(replica.url + "/phalanx/fault", json=spec, timeout=5.0)
    return f"r{f.replica}: {resp.json().get('applied') if resp.status_code == 200 else resp.text[:200]}"


async def run_fault_plan(faults: list[ServingFault], replicas: list[Any], token: bytes,
                         log: Callable[[str], None] = lambda _: None, t0: float | None = None) -> list[dict[str, Any]]:
    """Apply every fault at its ``at_s``; returns what happened when (for the run's report)."""
    start = time.monotonic() if t0 is None else t0
    done: list[dict[str, Any]] = []
    restarts: list[asyncio.Task[None]] = []
    async with httpx.AsyncClient(auth=ClusterTokenAuth(token)) as client:
        for f in sorted(faults, key=lambda f: (f.at_s, f.line)):
            await asyncio.sleep(max(0.0, start + f.at_s - time.monotonic()))
            if not 0 <= f.replica < len(replicas):
                log(f"line {f.line}: no replica {f.replica} (only {len(replicas)}); skipped")
                continue
            try:
                what = await apply_one(f, replicas[f.replica], client)
            except httpx.HTTPError as e:
                what = f"r{f.replica}: could not apply {f.kind} ({type(e).__name__})"
            done.append({"t_s": round(time.monotonic() - start, 3), "kind": f.kind, "replica": f.replica, "what": what})
            log(what)
            if f.kind == "kill" and f.restart and hasattr(replicas[f.replica], "restart"):
                restarts.append(asyncio.create_task(_restart(replicas[f.replica], f, start, done, log)))
        if restarts:
            await asyncio.gather(*restarts)  # bounded by the replica's start timeout
    return done


async def _restart(replica: Any, f: ServingFault, start: float, done: list[dict[str, Any]],
                   log: Callable[[str], None]) -> None:
    """In the background, so later faults keep their times: wait for the death, start a fresh process."""
    await asyncio.to_thread(replica.proc.wait, 10)
    await asyncio.to_thread(replica.restart)
    what = f"r{f.replica} restarted (pid {replica.proc.pid})"
    done.append({"t_s": round(time.monotonic() - start, 3), "kind": "restart", "replica": f.replica, "what": what})
    log(what)
