"""Authenticated router <-> replica HTTP, and the optional client API key on the public port.

The serving data plane is HTTP/SSE, so it cannot reuse the transport's framed handshake; it reuses
the cluster token instead. Every request the router sends carries ``X-Phalanx-Auth:
<unix_ms>.<nonce>.<mac>``, the MAC (``core.auth.request_mac``) covering method, path with query,
time, nonce and a SHA-256 of the body. A replica refuses a request without it (401), with a wrong
MAC, a time more than ``CLOCK_SKEW_S`` away, or a nonce it has already seen (403): a stranger on
the network can neither call a replica nor replay a captured request. Responses are not MACed
(they travel on the connection the router opened; TLS is what would protect them from a
man in the middle, see docs/SERVING.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Awaitable, Callable, Generator, MutableMapping
from typing import Any

import httpx

from phalanx.core.auth import macs_equal, new_nonce, request_mac

AUTH_HEADER = "x-phalanx-auth"
CLOCK_SKEW_S = 30.0  # a signed request older or newer than this is refused (replay window)
NONCES_MAX = 200_000  # remembered nonces (a full window at ~6,600 req/s per replica)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]


def sign_request(token: bytes, method: bytes, target: bytes, body: bytes, now_s: float, nonce: bytes) -> str:
    """``core.auth.request_mac`` over (method, target, time, nonce, SHA-256 of the body), computed in one
    ``hmac.digest`` call (OpenSSL's one-shot HMAC: no Python HMAC object per request; equal to ``request_mac``,
    tested)."""
    stamp = str(int(now_s * 1000)).encode()
    msg = b"phalanx-http\x00" + b"".join(len(p).to_bytes(8, "big") + p for p in
                                         (method.upper(), target, stamp, nonce, hashlib.sha256(body).digest()))
    return f"{stamp.decode()}.{nonce.hex()}.{hmac.digest(token, msg, 'sha256').hex()}"


class NonceWindow:
    """Nonces seen within the replay window (bounded: expired ones are dropped first)."""

    def __init__(self, entries_max: int = NONCES_MAX) -> None:
        self.entries_max = entries_max
        self.expiry_s: dict[bytes, float] = {}

    def admit(self, nonce: bytes, now_s: float) -> bool:
        if nonce in self.expiry_s:
            return False
        if len(self.expiry_s) >= self.entries_max:
            self.expiry_s = {n: t for n, t in self.expiry_s.items() if t > now_s}
            if len(self.expiry_s) >= self.entries_max:
                return False  # a flood of validly signed requests: refuse rather than grow without bound
        self.expiry_s[nonce] = now_s + 2 * CLOCK_SKEW_S
        return True


def check_request(token: bytes, header: bytes | None, method: bytes, target: bytes, body: bytes, now_s: float,
                  seen: NonceWindow) -> tuple[int, str] | None:
    """None when the request is authentic; otherwise (HTTP status, why). Pure except for ``seen``."""
    if header is None:
        return 401, "missing X-Phalanx-Auth: replicas only answer the router (signed with the cluster token)"
    try:
        stamp_s, nonce_hex, mac_hex = header.decode("ascii").split(".")
        stamp, nonce, mac = int(stamp_s), bytes.fromhex(nonce_hex), bytes.fromhex(mac_hex)
    except (ValueError, UnicodeDecodeError):
        return 403, "malformed X-Phalanx-Auth header"
    want = request_mac(token, [method.upper(), target, stamp_s.encode(), nonce, hashlib.sha256(body).digest()])
    if not macs_equal(mac, want):
        return 403, "request signature does not match (wrong cluster token, or the request was altered)"
    if abs(now_s - stamp / 1000) > CLOCK_SKEW_S:
        return 403, f"request signed {now_s - stamp / 1000:+.1f} s away from this replica's clock (limit {CLOCK_SKEW_S:g} s)"
    if len(nonce) < 8 or not seen.admit(nonce, now_s):
        return 403, "request replayed (nonce already seen)"
    return None


class ClusterTokenAuth(httpx.Auth):
    """httpx auth that signs every request (the router's client; tests pass it to the openai client)."""

    requires_request_body = True

    def __init__(self, token: bytes) -> None:
        self.token = token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers[AUTH_HEADER] = sign_request(self.token, request.method.encode(), request.url.raw_path,
                                                    request.content, time.time(), new_nonce())
        yield request


async def _send_error(send: Send, status: int, message: str, code: str, kind: str = "invalid_request_error") -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class RequireClusterToken:
    """ASGI middleware on the replica: every HTTP request must be signed by a holder of the cluster token."""

    def __init__(self, app: Asgi, token: bytes, body_bytes_max: int, clock: Callable[[], float] = time.time) -> None:
        self.app, self.token, self.body_bytes_max, self.clock = app, token, body_bytes_max, clock
        self.seen = NonceWindow()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(AUTH_HEADER.encode())
        if header is None:  # refuse before reading a stranger's body
            await _send_error(send, 401, "missing X-Phalanx-Auth: replicas only answer the router (signed with the "
                                         "cluster token)", "missing_cluster_token")
            return
        chunks, size = [], 0
        while True:  # bounded by body_bytes_max
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.body_bytes_max:
                await _send_error(send, 413, f"request body exceeds {self.body_bytes_max} bytes", "body_too_large")
                return
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        refused = check_request(self.token, header, scope["method"].encode(), target, body, self.clock(), self.seen)
        if refused is not None:
            await _send_error(send, refused[0], refused[1], "invalid_cluster_token")
            return
        replayed = False

        async def replay() -> MutableMapping[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls: the client's disconnect

        await self.app(scope, replay, send)


class RequireApiKey:
    """ASGI middleware on the router's public port: ``Authorization: Bearer <key>`` on /v1/ routes.
    /health, /ready and /metrics stay open for probes and scrapers."""

    def __init__(self, app: Asgi, api_key: str) -> None:
        self.app = app
        self.expected = b"Bearer " + api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                await _send_error(send, 401, "invalid or missing API key: pass it as 'Authorization: Bearer <key>' "
                                             "(the openai client's api_key)", "invalid_api_key")
                return
        await self.app(scope, receive, send)


class ClusterTokenOnAdmin:
    """ASGI middleware on the router's public port: admin routes (``/phalanx/...``: rollout, join) demand
    a request signed with the cluster token, exactly as replicas do; a router without a token refuses them."""

    ADMIN_PREFIX = "/phalanx/"

    def __init__(self, app: Asgi, token: bytes | None, body_bytes_max: int) -> None:
        self.app = app
        self.guard = RequireClusterToken(app, token, body_bytes_max) if token is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.ADMIN_PREFIX):
            await self.app(scope, receive, send)
        elif self.guard is None:
            await _send_error(send, 403, "this router has no cluster token: admin routes are off", "admin_disabled")
        else:
            await self.guard(scope, receive, send)
