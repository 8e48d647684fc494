"""Rollout: swap the replicas' weights one at a time with no failed request (the driver; the choices
are ``versions.next_to_swap`` and the routing constraints in ``versions.excluded_for``).

For each replica in id order: the router stops sending it new requests (``admitting = False``) and
waits for the ones in flight to finish (bounded); the replica loads and verifies the checkpoint
(``POST /phalanx/load``, signed with the cluster token; on any error it keeps the old weights and
the rollout stops there); it must then answer ``readmit_heartbeats`` health polls in a row and a probe
completion that names the new version; only then does it return to rotation and the next one
starts. ``follow_run`` does this for each new committed checkpoint of a training run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from phalanx.checkpoint.durable import latest_checkpoint, list_checkpoints
from phalanx.serve.router import VERSION_HEADER, ReplicaState, Router
from phalanx.serve.versions import next_to_swap


@dataclass(frozen=True)
class RolloutConfig:
    drain_timeout_s: float = 30.0  # in-flight requests on the replica being swapped finish within this
    load_timeout_s: float = 120.0  # reading, verifying and installing the checkpoint
    healthy_timeout_s: float = 15.0  # after the load: health polls and a probe completion must succeed


class RolloutBusy(Exception):
    """Another rollout is running on this router."""


def _log_nothing(_: str) -> None:
    pass


async def roll_out(router: Router, checkpoint: str, cfg: RolloutConfig = RolloutConfig(),
                   log: Callable[[str], None] = _log_nothing) -> dict[str, Any]:
    """Swap every admitted replica to ``checkpoint`` (a checkpoint folder or a run directory: its latest
    committed checkpoint, resolved once by the first replica). Returns a JSON-able report."""
    if router.rollout_lock.locked():
        raise RolloutBusy("a rollout is already running on this router")
    async with router.rollout_lock:
        t0 = time.monotonic()
        steps: list[dict[str, Any]] = []
        target, done = "", set()
        for _ in range(2 * len(router.replicas) + 1):  # each pass settles one replica
            rid, swap, why = next_to_swap([(i, r.version, r.stats.healthy) for i, r in router.replicas.items()],
                                          target or "\0unknown", frozenset(done))
            if rid is None:
                break
            done.add(rid)
            if not swap:
                steps.append({"replica": rid, "skipped": why})
                log(f"rollout: {why}")
                continue
            step = await _swap_one(router, router.replicas[rid], checkpoint, cfg)
            steps.append(step)
            log(f"rollout: {rid} " + (f"now serves {step['version']} ({step['took_s']} s)" if step["ok"]
                                       else f"failed: {step['error']}"))
            if not step["ok"]:
                return {"ok": False, "version": target or None, "error": f"{rid}: {step['error']}", "steps": steps,
                        "took_s": round(time.monotonic() - t0, 3)}
            if not target:
                target, checkpoint = step["version"], step["checkpoint"]  # the same checkpoint everywhere
        router.record_event(rollout=target, took_s=round(time.monotonic() - t0, 3))
        return {"ok": bool(target), "version": target or None, "checkpoint": checkpoint, "steps": steps,
                "took_s": round(time.monotonic() - t0, 3), **({} if target else {"error": "no replica to swap"})}


async def _swap_one(router: Router, r: ReplicaState, checkpoint: str, cfg: RolloutConfig) -> dict[str, Any]:
    rid, t0 = r.stats.replica_id, time.monotonic()
    r.admitting = False  # no new requests from here; a resumed stream of its version may still come
    try:
        deadline_s = t0 + cfg.drain_timeout_s
        while r.stats.outstanding > 0 and time.monotonic() < deadline_s:  # bounded by the deadline
            await asyncio.sleep(0.01)
        drained_s = time.monotonic() - t0
        try:
            resp = await router.client.post(r.url + "/phalanx/load", timeout=cfg.load_timeout_s, json={
                "checkpoint": checkpoint, "drain_timeout_s": max(1.0, deadline_s - time.monotonic())})
            payload = resp.json()
        except (httpx.HTTPError, ValueError) as e:
            return {"replica": rid, "ok": False, "error": f"load request failed: {type(e).__name__}: {e}"}
        if resp.status_code != 200 or not isinstance(payload, dict) or not isinstance(payload.get("version"), str):
            msg = ((payload.get("error") or {}).get("message") if isinstance(payload, dict) else None) or str(payload)
            return {"replica": rid, "ok": False, "error": f"HTTP {resp.status_code}: {msg}"}
        r.version = payload["version"]
        rank = router.book.promote(r.version)
        loaded_s = time.monotonic() - t0
        r.good_polls = 0  # it must prove healthy again from here
        proof = await _wait_for_proof(router, r, cfg.healthy_timeout_s)
        if proof is not None:
            return {"replica": rid, "ok": False, "error": proof}
        return {"replica": rid, "ok": True, "version": r.version, "rank": rank, "checkpoint": payload["checkpoint"],
                "drained_s": round(drained_s, 3), "loaded_s": round(loaded_s, 3),
                "took_s": round(time.monotonic() - t0, 3)}
    finally:
        r.admitting = True


async def _wait_for_proof(router: Router, r: ReplicaState, timeout_s: float) -> str | None:
    """None once the replica answered ``readmit_heartbeats`` polls and a probe completion with its new
    version; otherwise why not (bounded by ``timeout_s``)."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s and not (r.stats.healthy and r.good_polls >= router.cfg.readmit_heartbeats):
        await asyncio.sleep(0.02)
    if not r.stats.healthy:
        return f"not healthy {timeout_s:g} s after loading"
    body = {"model": router.cfg.model_name, "prompt": "The ", "max_tokens": 1, "seed": 0}
    try:
        resp = await router.client.post(r.url + "/v1/completions", json=body,
                                        timeout=max(0.5, deadline_s - time.monotonic()))
    except httpx.HTTPError as e:
        return f"probe completion failed: {type(e).__name__}"
    if resp.status_code != 200 or resp.headers.get(VERSION_HEADER) != r.version:
        return f"probe completion answered HTTP {resp.status_code} from {resp.headers.get(VERSION_HEADER)}"
    return None


async def follow_run(router: Router, run_dir: Path, poll_s: float = 2.0, cfg: RolloutConfig = RolloutConfig(),
                     log: Callable[[str], None] = _log_nothing) -> None:
    """Roll out each new committed checkpoint of a (still training) run; runs until cancelled."""
    seen: Path | None = None
    while True:  # a watcher: ends when its task is cancelled with the server
        names = list_checkpoints(run_dir)
        if names and names[-1] != seen:
            seen = names[-1]
            found = latest_checkpoint(run_dir)  # verified (SHA-256); a torn or corrupt newest one is skipped
            if found is not None and _serving_elsewhere(router, found[0]):
                log(f"follow: new checkpoint {found[0]}")
                try:
                    report = await roll_out(router, str(found[0]), cfg, log)
                    log(f"follow: rollout of {report.get('version')} " + ("done" if report["ok"] else
                                                                           f"stopped: {report.get('error')}"))
                except RolloutBusy:
                    seen = None  # try again at the next poll
        await asyncio.sleep(poll_s)


def _serving_elsewhere(router: Router, ckpt: Path) -> bool:
    version = f"{ckpt.parent.parent.name}/{ckpt.name}"  # as served_model names it
    return any(r.version != version for r in router.replicas.values() if r.stats.healthy)
