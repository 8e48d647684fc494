"""The admin calls to a running router, signed with the cluster token like router -> replica traffic:
``phalanx serve rollout`` (swap every replica to a checkpoint) and a replica's ``--join``."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import httpx

from phalanx.serve.errors import ServeError
from phalanx.serve.request_auth import ClusterTokenAuth


class AdminCallFailed(ServeError):
    status, code, kind = 502, "admin_call_failed", "server_error"


def router_url(where: str) -> str:
    """``HOST:PORT`` or a URL -> the router's base URL."""
    where = where.rstrip("/").removesuffix("/v1")
    return where if where.startswith(("http://", "https://")) else f"http://{where}"


def request_rollout(router: str, token: bytes, checkpoint: str, timeout_s: float = 600.0) -> tuple[int, dict[str, Any]]:
    """Ask the router to roll ``checkpoint`` out; returns (HTTP status, report) when it is done."""
    try:
        with httpx.Client(auth=ClusterTokenAuth(token), timeout=httpx.Timeout(timeout_s, connect=5.0)) as c:
            resp = c.post(router_url(router) + "/phalanx/rollout", json={"checkpoint": checkpoint})
            payload = resp.json()
    except (httpx.HTTPError, ValueError) as e:
        raise AdminCallFailed(f"could not reach the router at {router_url(router)}: {type(e).__name__}: {e}") from e
    if not isinstance(payload, dict):
        raise AdminCallFailed(f"the router answered {resp.status_code} with a JSON {type(payload).__name__}")
    return resp.status_code, payload


def default_replica_id(port: int) -> str:
    return f"{socket.gethostname().split('.')[0]}-{port}".replace(".", "-")[:64]


async def join_router(router: str, token: bytes, replica_id: str, url: str, attempts_max: int = 30,
                      retry_s: float = 1.0, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Register this replica with a running router (retried while the router is not up yet)."""
    last = "no attempt"
    async with httpx.AsyncClient(auth=ClusterTokenAuth(token), timeout=5.0) as c:
        for _ in range(attempts_max):
            try:
                resp = await c.post(router_url(router) + "/phalanx/join", json={"replica_id": replica_id, "url": url})
                payload = resp.json()
                if resp.status_code == 200 and isinstance(payload, dict):
                    return payload
                last = f"HTTP {resp.status_code}: {payload}"
                if resp.status_code in (400, 401, 403, 409):
                    break  # wrong token, bad id, id taken: retrying will not help
            except (httpx.HTTPError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            log(f"join {router_url(router)}: {last}; retrying")
            await asyncio.sleep(retry_s)
    raise AdminCallFailed(f"could not join the router at {router_url(router)}: {last}")
