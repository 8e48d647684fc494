"""The router: one OpenAI-compatible front for N replicas that survives slow, frozen and dead ones.

Decisions (which replica, retry, hedge, eject) come from ``routing_policy``; membership uses the
training failure detector's heartbeat rule on /health polls, plus a progress rule (a replica with
a running batch whose decode step count stands still is hung). This module is the thin driver:
membership, choosing a replica (with the rollout's version constraints from ``versions``), unary
requests with retries and hedging. Streams and their resumption are in ``stream_relay``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgspec

from phalanx.membership.failure_detector import Liveness, heartbeat_suspects
from phalanx.serve.replica_client import Abandoned, ReplicaConnections
from phalanx.serve.request_auth import ClusterTokenAuth
from phalanx.serve.router_metrics import RouterMetrics
from phalanx.serve.routing_policy import (HeldRequest, ReplicaStats, RequestSizes, RollingLatency,
                                          after_failure,
                                          backoff_s, choose_replica, hedge_delay_s, hedge_target, held_to_move,
                                          latency_outliers, may_hedge, may_retry, may_wait_for_replica)
from phalanx.serve.router_state import (AttemptFailed, NoHealthyReplica, ReplicaState, RouterConfig,
                                        VersionHeldBack)
from phalanx.serve.versions import ReplicaVersion, SessionVersions, VersionBook, excluded_for

VERSION_HEADER = "x-phalanx-model-version"
# msgspec for the request's bytes out and the replica's answer in (~10 us a request less than json; Session 15)
_decode_json = msgspec.json.Decoder().decode
_encode_json = msgspec.json.Encoder().encode


class Router:
    def __init__(self, replica_urls: dict[str, str], cfg: RouterConfig = RouterConfig(), seed: int = 0,
                 token: bytes | None = None) -> None:
        self.cfg = cfg
        self.token = token
        self.replicas = {rid: self._replica_state(rid, url) for rid, url in sorted(replica_urls.items())}
        self.rng = random.Random(seed)
        self.rr = 0
        self.active = 0
        self.retries_in_flight = 0
        self.requests_total = 0
        self.hedges_total = 0
        self.moves_total = 0
        self.no_replica_since_s: float | None = None  # when the last replica left rotation (None: one is in it)
        self._keys = itertools.count()
        self.history = RollingLatency()
        self.sizes = RequestSizes()  # the EWMA learns each answer's time per typical-size request
        self.metrics = RouterMetrics()
        self.events: list[dict[str, Any]] = []  # membership changes with reasons (bounded)
        self.book = VersionBook()
        self.sessions = SessionVersions()
        self.rollout_lock = asyncio.Lock()  # one rollout at a time
        # every request to a replica is signed with the cluster token (replicas refuse anything else)
        self.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
                                        auth=ClusterTokenAuth(token) if token is not None else None)

    def _replica_state(self, replica_id: str, url: str) -> ReplicaState:
        r = ReplicaState(ReplicaStats(replica_id), url)
        r.conns = ReplicaConnections(url, self.token)
        return r

    def close_connections(self) -> None:
        for r in self.replicas.values():
            r.conns.close()

    def stats(self) -> list[ReplicaStats]:
        return [r.stats for r in self.replicas.values()]

    def record_event(self, **kw: Any) -> None:
        if len(self.events) < 10_000:
            self.events.append({"t_s": time.monotonic(), **kw})

    # --- membership ----------------------------------------------------------------------------
    async def watch_membership(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(r) for r in self.replicas.values()))
            self._decide_membership(time.monotonic())
            await asyncio.sleep(self.cfg.detector.heartbeat_interval_s)

    async def _poll(self, r: ReplicaState) -> None:
        try:
            resp = await r.conns.get("/health", self.cfg.detector.heartbeat_timeout_s / 2)
            h = json.loads(resp.body)
            steps, busy = int(h["steps"]), int(h["batch_size"]) + int(h.get("queue_depth", 0)) > 0
            step_time_s = float(h.get("step_time_s", 0.0))
            if isinstance(h.get("version"), str) and h["version"] != r.version:
                r.version = h["version"]
                self.book.learn(r.version)
            if resp.status != 200 or h.get("draining") or h.get("loading"):
                raise ValueError("draining" if h.get("draining") or h.get("loading") else f"HTTP {resp.status}")
        except (OSError, asyncio.IncompleteReadError, ValueError, KeyError, TypeError, AttributeError) as e:
            r.good_polls = 0
            if isinstance(e, ConnectionRefusedError):
                r.connected = False  # refused: the process is gone (a timeout only ages the heartbeat)
            return
        now = time.monotonic()
        r.connected, r.last_heartbeat_s = True, now
        r.good_polls += 1
        if steps != r.steps or not busy:
            r.steps, r.steps_changed_s = steps, now
        r.busy, r.step_time_s = busy, step_time_s

    def _decide_membership(self, now: float) -> None:
        live = {rid: Liveness(r.connected and r.good_polls > 0, r.last_heartbeat_s) for rid, r in self.replicas.items()}
        suspects = {s.worker_id: s.reason for s in heartbeat_suspects(now, live, self.cfg.detector)}
        for rid, r in self.replicas.items():
            stalled_max_s = max(self.cfg.progress_timeout_s, self.cfg.progress_steps_max * r.step_time_s)
            if rid not in suspects and r.busy and now - r.steps_changed_s > stalled_max_s:
                suspects[rid] = f"no decode progress for {now - r.steps_changed_s:.2f} s with a running batch"
            was = r.stats.healthy
            if rid in suspects:
                r.stats.healthy = False
            elif r.good_polls >= (self.cfg.readmit_heartbeats if r.ever_healthy else 1):
                r.stats.healthy = r.ever_healthy = True
            if was != r.stats.healthy:
                self.record_event(replica=rid, healthy=r.stats.healthy, reason=suspects.get(rid, "heartbeats and progress"))
            self.metrics.healthy.labels(rid).set(1 if r.stats.healthy else 0)
            self.metrics.version_rank.labels(rid).set(self.book.rank(r.version))
        ejected_now: set[str] = set()
        if any(r.stats.healthy for r in self.replicas.values()):
            self.no_replica_since_s = None
        elif self.no_replica_since_s is None:
            self.no_replica_since_s = now
        for s, why in latency_outliers(now, self.stats(), self.cfg.policy):
            s.ejected_until_s = now + self.cfg.policy.ejection_s
            ejected_now.add(s.replica_id)
            self._ejected(self.replicas[s.replica_id], "latency", why, now)
        if self.cfg.policy.ejection_moves_later:  # what stayed at the ejection is re-decided every tick
            for rid, r in self.replicas.items():
                if r.stats.ejected_until_s > now and rid not in ejected_now and r.held:
                    self._move_held(r, now)

    def _ejected(self, r: ReplicaState, kind: str, why: str, now: float) -> None:
        """An ejected replica's requests without output move now, as far as ``held_to_move`` allows (else they
        would wait out its backlog): marked here, each attempt sees its mark within 50 ms and moves."""
        self.metrics.ejections.labels(r.stats.replica_id, kind).inc()
        self.record_event(replica=r.stats.replica_id, ejected=True, reason=why)
        self._move_held(r, now)

    def _move_held(self, r: ReplicaState, now: float) -> None:
        held = [HeldRequest(k, t, moved) for k, (t, moved) in r.held.items() if k not in r.move_keys]
        for key, reason in held_to_move(now, r.stats, held, self.stats(), self.cfg.policy, self.active):
            r.move_keys.add(key)
            self.moves_total += 1
            self.metrics.moves.labels(r.stats.replica_id).inc()
            self.record_event(replica=r.stats.replica_id, moved=key, reason=reason)

    def hold(self, r: ReplicaState, started_s: float, moved_before: bool) -> int:
        """An attempt on ``r`` that has produced no output yet; ``release`` it once it has (or has ended)."""
        key = next(self._keys)
        r.held[key] = (started_s, moved_before)
        return key

    def release(self, r: ReplicaState, key: int) -> None:
        r.held.pop(key, None)
        r.move_keys.discard(key)

    def _suspect_now(self, r: ReplicaState, reason: str) -> None:
        """A request saw the replica refuse connections: out of rotation at once, not at the next poll."""
        if r.stats.healthy:
            r.stats.healthy = False
            r.good_polls = 0
            self.record_event(replica=r.stats.replica_id, healthy=False, reason=reason)

    # --- choosing ------------------------------------------------------------------------------
    def _choose(self, exclude: frozenset[str], session: str | None = None, pinned: str | None = None) -> ReplicaState:
        """``exclude``: replicas already tried (a preference); the rollout's and the session's version
        constraints (``versions.excluded_for``) are hard."""
        now = time.monotonic()
        hard, why = self._version_excluded(session, pinned)
        picked, _ = choose_replica(now, self.stats(), self.cfg.policy, self.rng, self.rr, exclude | hard)
        self.rr += 1
        if picked is None and exclude:
            picked, _ = choose_replica(now, self.stats(), self.cfg.policy, self.rng, self.rr, hard)
        if picked is None:
            if hard and choose_replica(now, self.stats(), self.cfg.policy, self.rng, self.rr)[0] is not None:
                raise VersionHeldBack(f"no replica may serve this request now ({why})")
            raise NoHealthyReplica("no healthy replica")
        return self.replicas[picked.replica_id]

    def _version_excluded(self, session: str | None, pinned: str | None = None) -> tuple[frozenset[str], str]:
        return excluded_for([ReplicaVersion(rid, r.version, self.book.rank(r.version), r.admitting)
                             for rid, r in self.replicas.items()], self.cfg.consistency, self.sessions.floor(session),
                            pinned)

    async def choose_waiting(self, exclude: frozenset[str], session: str | None = None, pinned: str | None = None
                              ) -> ReplicaState:
        """``_choose``, waiting up to ``version_wait_s`` while a rollout holds the request back, and while no
        replica is in rotation for as long as ``may_wait_for_replica`` allows (then ``NoHealthyReplica``)."""
        start_s = time.monotonic()
        deadline_s = start_s + self.cfg.version_wait_s
        hard_deadline_s = deadline_s + self.cfg.outage_wait_s  # replicas flapping in and out cannot extend it
        waited = outage_waited = False
        while True:  # bounded by the deadlines
            try:
                r = self._choose(exclude, session, pinned)
            except NoHealthyReplica:
                now = time.monotonic()
                if self.no_replica_since_s is None:  # left between two polls (a refused connection)
                    self.no_replica_since_s = now
                if now >= hard_deadline_s or not may_wait_for_replica(now, self.no_replica_since_s,
                                                                      self.cfg.outage_wait_s)[0]:
                    raise
                if not outage_waited:
                    self.metrics.outage_waits.inc()
                outage_waited = True
                await asyncio.sleep(0.02)
                continue
            except VersionHeldBack:
                if time.monotonic() >= min(deadline_s, hard_deadline_s):
                    self.metrics.version_refusals.inc()
                    raise
                waited = True
                await asyncio.sleep(0.02)
                continue
            if waited:
                self.metrics.version_waits.inc()
            return r

    def observe_version(self, session: str | None, version: str | None) -> None:
        if session is not None and version:
            self.sessions.observe(session, self.book.rank(version))

    def add_replica(self, replica_id: str, url: str) -> bool:
        """A replica that joined (``phalanx serve replica --join``): polled from now on, admitted once it
        answers healthy. Returns False when this id is already a member (at that URL: a repeated join)."""
        if replica_id in self.replicas:
            return self.replicas[replica_id].url == url
        self.replicas[replica_id] = self._replica_state(replica_id, url)
        self.replicas = dict(sorted(self.replicas.items()))
        self.record_event(replica=replica_id, joined=url)
        return True

    def note_failure(self, r: ReplicaState, e: BaseException) -> None:
        if isinstance(e, (httpx.ConnectError, ConnectionRefusedError)):
            self._suspect_now(r, f"connection refused ({e})")
        self.record_event(replica=r.stats.replica_id, failed=f"{type(e).__name__}: {e}"[:200])
        ejected, why = after_failure(time.monotonic(), r.stats, self.cfg.policy)
        if ejected:
            self._ejected(r, "failures", why, time.monotonic())

    # --- unary ---------------------------------------------------------------------------------
    async def _attempt(self, r: ReplicaState, path: str, body: bytes, abandon: Callable[[], bool] | None = None
                       ) -> tuple[int, Any, str]:
        """One try; a 200 answer comes back as the replica's bytes (checked to be a JSON object, passed
        through without re-encoding), any other as the parsed error object. ``abandon``: see ``_sole_attempt``."""
        ahead = r.stats.outstanding  # what it already had: the EWMA learns the time per request
        r.stats.outstanding += 1
        t0 = time.monotonic()
        r.stats.inflight_since_s.append(t0)
        try:
            resp = await r.conns.post(path, body, self.cfg.request_timeout_s, abandon=abandon)
            payload = _decode_json(resp.body)
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:  # OSError: refused, reset, timed out, garbage
            self.note_failure(r, e)
            gone = isinstance(e, (ConnectionRefusedError, ConnectionResetError, BrokenPipeError,
                                  asyncio.IncompleteReadError))
            raise AttemptFailed(f"{r.stats.replica_id}: {type(e).__name__}: {e}", gone) from e
        finally:
            r.stats.outstanding -= 1
            r.stats.inflight_since_s.remove(t0)
        if resp.status >= 500 or resp.status == 429 or not isinstance(payload, dict):
            self.note_failure(r, RuntimeError(str(resp.status)))
            draining = isinstance(payload, dict) and (payload.get("error") or {}).get("code") == "draining"
            raise AttemptFailed(f"{r.stats.replica_id}: HTTP {resp.status}", draining)
        if resp.status == 200:
            usage = payload.get("usage")
            tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
            r.stats.observe(time.monotonic() - t0, self.cfg.policy.ewma_alpha, ahead,
                            self.sizes.size(tokens if isinstance(tokens, int) else None))
            return 200, resp.body, resp.headers.get(VERSION_HEADER, r.version)
        return resp.status, payload, resp.headers.get(VERSION_HEADER, r.version)

    async def unary(self, path: str, body: dict[str, Any], session: str | None = None) -> tuple[int, Any, str]:
        tried: set[str] = set()
        last, gone, moved = "no attempt", False, False
        data = _encode_json(body)  # once, whatever the number of tries
        for attempt in range(self.cfg.attempts_max):
            if attempt:
                ok, why = may_retry(self.active, self.retries_in_flight, attempt, self.cfg.policy, self.cfg.attempts_max,
                                    gone)
                if not ok:
                    break
                await asyncio.sleep(backoff_s(attempt, self.rng))
            try:
                r = await self.choose_waiting(frozenset(tried), session)
            except VersionHeldBack as e:
                return 503, {"error": {"message": f"{e}; retry shortly", "type": "server_error", "param": None,
                                       "code": "version_unavailable"}}, ""
            except AttemptFailed as e:
                last, gone = str(e), True
                await asyncio.sleep(0.05)
                continue
            tried.add(r.stats.replica_id)
            if attempt:
                self.retries_in_flight += 1
                self.metrics.retries.labels(r.stats.replica_id).inc()
            try:
                status, payload, version = await self._hedged(r, path, data, tried, session, moved)
                if status == 200:
                    self.observe_version(session, version)
                return status, payload, version
            except AttemptFailed as e:
                last, gone, moved = str(e), e.replica_gone, moved or e.moved
            finally:
                if attempt:
                    self.retries_in_flight -= 1
        return 503, {"error": {"message": f"no replica could serve the request ({last})", "type": "server_error",
                               "param": None, "code": "replicas_unavailable"}}, ""

    async def _sole_attempt(self, r: ReplicaState, path: str, body: bytes, moved: bool) -> tuple[int, Any, str]:
        """One attempt and no hedge (hedging off, or no p95 yet), in the caller's task: the hot path, with no
        task and no wait loop per request (they cost two event-loop turns and ~9 % of the router's CPU under cProfile). The
        same two rules as ``_hedged``'s loop, asked as often (``ABANDON_CHECK_S``): a replica that left
        rotation, or was ejected with the request still waiting there, gives it up (its connection closes, so the
        replica cancels the work) and it moves."""
        key = self.hold(r, time.monotonic(), moved)  # no output until it answers: an ejection may move it
        try:
            return await self._attempt(r, path, body, lambda: not r.stats.healthy or key in r.move_keys)
        except Abandoned:
            if not r.stats.healthy:
                raise AttemptFailed(f"{r.stats.replica_id} left rotation with the request in flight", True) from None
            raise AttemptFailed(f"{r.stats.replica_id} was ejected; the request moves", moved=True) from None
        finally:
            self.release(r, key)

    async def _hedged(self, r: ReplicaState, path: str, body: bytes, tried: set[str], session: str | None,
                      moved: bool = False) -> tuple[int, Any, str]:
        delay = hedge_delay_s(self.history, self.cfg.policy) if self.cfg.hedging else None
        if delay is None:
            return await self._sole_attempt(r, path, body, moved)
        ahead, t0 = r.stats.outstanding, time.monotonic()
        primary = asyncio.ensure_future(self._attempt(r, path, body))
        tasks = {primary}
        owner = {primary: r}
        keys = {primary: self.hold(r, t0, moved)}  # no output until it answers: an ejection may move it
        try:
            done, _ = await asyncio.wait(tasks, timeout=delay)
            if not done and may_hedge(self.requests_total, self.hedges_total, self.cfg.policy)[0]:
                # only to a replica expected to finish first (a hedge into a queue just adds load)
                hard, _ = self._version_excluded(session)
                picked, _ = hedge_target(time.monotonic(), self.stats(), r.stats, ahead, time.monotonic() - t0,
                                         self.cfg.policy, frozenset(tried) | hard)
                if picked is not None:
                    other = self.replicas[picked.replica_id]
                    tried.add(other.stats.replica_id)
                    self.hedges_total += 1
                    self.metrics.hedges.inc()
                    hedge = asyncio.ensure_future(self._attempt(other, path, body))
                    tasks.add(hedge)
                    owner[hedge] = other
                    keys[hedge] = self.hold(other, time.monotonic(), moved)
            error: BaseException | None = None
            while tasks:  # bounded: each attempt ends by answer, error, timeout or its replica leaving rotation
                done, tasks = await asyncio.wait(tasks, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if t.exception() is None:
                        return t.result()  # the first answer wins; the loser is cancelled below
                    error = t.exception()
                for t in [t for t in tasks if not owner[t].stats.healthy]:
                    # frozen, hung or partitioned with the request in flight: nothing was sent to the
                    # client, so it moves now instead of waiting out the fault (one answer at most: the
                    # cancelled attempt's connection is closed)
                    t.cancel()
                    tasks.discard(t)
                    error = AttemptFailed(f"{owner[t].stats.replica_id} left rotation with the request in flight", True)
                for t in [t for t in tasks if keys[t] in owner[t].move_keys]:
                    # ejected with this request still waiting there: it moves (once), cancelled at the replica
                    t.cancel()
                    tasks.discard(t)
                    error = AttemptFailed(f"{owner[t].stats.replica_id} was ejected; the request moves", moved=True)
            assert error is not None
            raise error
        finally:
            for t in tasks:
                t.cancel()  # closes the loser's connection; its replica cancels the generation
            for t, key in keys.items():
                self.release(owner[t], key)
