"""``phalanx sim serve``: the router's decisions at scale, in virtual time.

The very functions the real router calls (``routing_policy``: P2C x latency, P2C-queue, round-robin,
retry budget, hedging at the rolling p95, outlier ejection; ``membership.failure_detector``'s
heartbeat rule) decide here too; only the replicas and the network are modelled: a replica serves
``slots`` requests at a time, each taking ``service_s`` x its straggler factor x U(0.8, 1.2), from
a FIFO queue. Faults come from the same serving fault plans (kill, freeze, hang, straggler,
latency, loss, partition). The code is plain asyncio reading ``loop.time()``: the caller runs it on
``sim.loop.VirtualTimeLoop`` (this layer may not import ``sim``), so the same seed gives the same
result, and an hour of traffic on 64 replicas takes seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from phalanx.membership.failure_detector import DetectorConfig, Liveness, heartbeat_suspects
from phalanx.serve.loadtest import quantile
from phalanx.serve.replica_faults import RTO_MIN_S
from phalanx.serve.routing_policy import (POLICY_NAMES, HeldRequest, Policy, PolicyConfig, ReplicaStats,
                                          RollingLatency, after_failure, backoff_s, choose_replica, hedge_delay_s,
                                          hedge_target, held_to_move, latency_outliers, may_hedge, may_retry,
                                          may_wait_for_replica)
from phalanx.serve.serving_faults import ServingFault


@dataclass(frozen=True)
class SimServeConfig:
    replicas: int = 64
    rate_per_s: float = 300.0
    duration_s: float = 30.0
    service_s: float = 0.1
    slots: int = 1  # requests a replica serves at once (the Ray Serve anchor: one)
    policy: Policy = Policy.P2C_LATENCY
    hedging: bool = False
    seed: int = 0
    attempts_max: int = 4
    progress_timeout_s: float = 0.8
    detector: DetectorConfig = DetectorConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.6)
    policy_config: PolicyConfig | None = None  # the router's tunables (budgets, ratios); its policy is ``policy``
    # calibration from a real run (bench serving): its arrival schedule, replayed instead of fresh Poisson draws;
    # a warm-up schedule run first (answered before the measured one starts, as the benchmark does); measured
    # service times of one request on a healthy replica, drawn from instead of service_s x U(0.8, 1.2); the
    # router's own time per request
    arrivals_s: tuple[float, ...] | None = None
    warmup_arrivals_s: tuple[float, ...] = ()
    service_samples_s: tuple[float, ...] | None = None
    router_hop_s: float = 0.0
    outage_wait_s: float = 2.0  # RouterConfig.outage_wait_s: no replica in rotation, a request waits this long at most


RESTART_S = 3.0  # a killed replica with restart = true is serving again this long after (the model loads)


class ReplicaGone(Exception):
    def __init__(self, replica_gone: bool) -> None:
        super().__init__("replica gone" if replica_gone else "failed")
        self.replica_gone = replica_gone


class Moved(ReplicaGone):
    """Its replica was ejected with this request still waiting there: it moves (as the router's AttemptFailed(moved))."""

    def __init__(self) -> None:
        super().__init__(True)


@dataclass
class SimReplica:
    stats: ReplicaStats
    alive: bool = True
    frozen_until_s: float = 0.0
    hung_until_s: float = 0.0
    partition_until_s: float = 0.0
    factor: float = 1.0
    latency_s: float = 0.0
    loss_probability: float = 0.0
    queue: deque[asyncio.Future[None]] = field(default_factory=deque)
    pending: set[asyncio.Future[None]] = field(default_factory=set)
    running: int = 0
    last_progress_s: float = 0.0
    last_heartbeat_s: float = 0.0
    good_polls: int = 0
    ever_healthy: bool = False
    served: int = 0  # answers it finished (a cancelled hedge loser or moved request is not one)
    held: dict[int, tuple[float, bool, asyncio.Future[None]]] = field(default_factory=dict)  # attempts without an
    # answer yet: key -> (start, moved before, its future at the replica); an ejection may move them


class ServeSim:
    def __init__(self, cfg: SimServeConfig, faults: list[ServingFault]) -> None:
        self.cfg, self.faults = cfg, faults
        self.pcfg = dataclasses.replace(cfg.policy_config or PolicyConfig(), policy=cfg.policy)
        self.reps = [SimReplica(ReplicaStats(f"r{i:03d}")) for i in range(cfg.replicas)]
        self.rng_policy = random.Random(f"policy:{cfg.seed}")
        self.rng_service = random.Random(f"service:{cfg.seed}")
        self.rng_net = random.Random(f"net:{cfg.seed}")
        self.history = RollingLatency()
        self.latencies_s: list[float] = []
        self.starts_s: list[float] = []  # when each answered request arrived, from the measured part's start
        self.t0_s = 0.0
        self.failed = self.retries = self.hedges = self.requests = self.active = self.retries_in_flight = 0
        self.moves = self.keys = 0
        self.no_replica_since_s: float | None = None  # the router's: when the last replica left rotation
        self.rr = 0
        self.detections: list[dict[str, Any]] = []
        self.by_id = {r.stats.replica_id: r for r in self.reps}

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    # --- replicas (the model) ------------------------------------------------------------------------
    def _net_delay_s(self, r: SimReplica) -> float:
        """Latency plus TCP retransmissions for lost segments (200 ms RTO, doubling), as replica_faults does."""
        wait, rto = r.latency_s, RTO_MIN_S
        for _ in range(6):
            if self.rng_net.random() >= r.loss_probability:
                break
            wait, rto = wait + rto, rto * 2
        return wait

    async def _serve_one(self, r: SimReplica, fut: asyncio.Future[None]) -> None:
        try:  # r.running was counted by _start_next when it took the request off the queue  # a cancelled request (hedge loser, moved) frees its slot at once, as the engine's cancel does
            await asyncio.wait({fut}, timeout=self._service_s(r))
            while max(r.frozen_until_s, r.hung_until_s) > self.now():  # a stopped engine frees nothing,
                await asyncio.sleep(max(r.frozen_until_s, r.hung_until_s) - self.now())  # not even cancelled work
            while not fut.done() and r.partition_until_s > self.now():  # the answer cannot leave yet
                await asyncio.wait({fut}, timeout=r.partition_until_s - self.now())
            if r.alive and not fut.done():
                fut.set_result(None)
                r.served += 1
        finally:
            r.running -= 1
            self._start_next(r)

    def _service_s(self, r: SimReplica) -> float:
        if self.cfg.service_samples_s:
            return r.factor * self.rng_service.choice(self.cfg.service_samples_s)
        return self.cfg.service_s * r.factor * self.rng_service.uniform(0.8, 1.2)

    def _start_next(self, r: SimReplica) -> None:
        while r.alive and r.running < self.cfg.slots and r.queue:
            fut = r.queue.popleft()
            if not fut.done():
                r.running += 1  # counted now, not when the task first runs: another _start_next in the same
                assert r.running <= self.cfg.slots  # instant must see the slot taken
                asyncio.ensure_future(self._serve_one(r, fut))

    async def _call(self, r: SimReplica, fut: asyncio.Future[None]) -> None:
        """One attempt at one replica, as the router's HTTP call sees it (``fut``: its answer; a move fails it)."""
        if not r.alive:
            raise ReplicaGone(True)  # connection refused at once
        await asyncio.sleep(self._net_delay_s(r))
        while max(r.partition_until_s, r.frozen_until_s) > self.now():  # no answer until it heals or thaws
            await asyncio.sleep(max(r.partition_until_s, r.frozen_until_s) - self.now())
        if not r.alive:
            raise ReplicaGone(True)
        if not fut.done():  # moved already: never queued
            r.queue.append(fut)
        r.pending.add(fut)
        try:
            self._start_next(r)
            await fut
        finally:
            r.pending.discard(fut)
            fut.cancel()
        await asyncio.sleep(self._net_delay_s(r))

    def _fail_pending(self, r: SimReplica) -> None:
        for fut in list(r.pending):
            if not fut.done():
                fut.set_exception(ReplicaGone(True))

    # --- the router (the same decisions as serve.router) ------------------------------------------
    async def _attempt(self, r: SimReplica, moved: bool = False) -> None:
        ahead = r.stats.outstanding  # what it already had: the EWMA learns the time per request
        r.stats.outstanding += 1
        t0 = self.now()
        r.stats.inflight_since_s.append(t0)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.keys += 1
        key = self.keys
        r.held[key] = (t0, moved, fut)
        try:
            await self._call(r, fut)
        except Moved:
            raise  # not the replica's failure
        except ReplicaGone:
            if not r.alive and r.stats.healthy:
                self._set_health(r, False, "connection refused")
            if after_failure(self.now(), r.stats, self.pcfg)[0]:
                self._move_held(r)
            raise
        finally:
            r.held.pop(key, None)
            r.stats.outstanding -= 1
            r.stats.inflight_since_s.remove(t0)
        r.stats.observe(self.now() - t0, self.pcfg.ewma_alpha, ahead)

    def _move_held(self, r: SimReplica) -> None:
        """The router's ``_move_held``: the requests ``held_to_move`` picks leave the ejected replica now."""
        held = [HeldRequest(k, t, moved) for k, (t, moved, fut) in r.held.items() if not fut.done()]  # not yet gone
        for key, _ in held_to_move(self.now(), r.stats, held, [x.stats for x in self.reps], self.pcfg, self.active):
            fut = r.held[key][2]
            if not fut.done():
                fut.set_exception(Moved())  # a queued one is skipped, a running one frees its slot at once
                self.moves += 1

    def _choose(self, tried: set[str]) -> SimReplica | None:
        stats = [r.stats for r in self.reps]
        picked, _ = choose_replica(self.now(), stats, self.pcfg, self.rng_policy, self.rr, frozenset(tried))
        self.rr += 1
        if picked is None:
            picked, _ = choose_replica(self.now(), stats, self.pcfg, self.rng_policy, self.rr)
        return None if picked is None else self.by_id[picked.replica_id]

    async def _hedged(self, r: SimReplica, tried: set[str], moved: bool = False) -> None:
        ahead, t0 = r.stats.outstanding, self.now()
        tasks = {asyncio.ensure_future(self._attempt(r, moved))}
        delay = hedge_delay_s(self.history, self.pcfg) if self.cfg.hedging else None
        try:
            if delay is not None:
                done, _ = await asyncio.wait(tasks, timeout=delay)
                if not done and may_hedge(self.requests, self.hedges, self.pcfg)[0]:
                    picked, _ = hedge_target(self.now(), [x.stats for x in self.reps], r.stats, ahead, self.now() - t0,
                                             self.pcfg, frozenset(tried))
                    other = None if picked is None else self.by_id[picked.replica_id]
                    if other is not None:
                        tried.add(other.stats.replica_id)
                        self.hedges += 1
                        tasks.add(asyncio.ensure_future(self._attempt(other, moved)))
            error: BaseException | None = None
            while tasks:
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if t.exception() is None:
                        return
                    error = t.exception()
            assert error is not None
            raise error
        finally:
            for t in tasks:
                t.cancel()

    async def _request(self) -> None:
        t0 = self.now()
        self.active += 1
        self.requests += 1
        tried: set[str] = set()
        gone = moved = False
        try:
            if self.cfg.router_hop_s:
                await asyncio.sleep(self.cfg.router_hop_s)
            for attempt in range(self.cfg.attempts_max):
                if attempt:
                    if not may_retry(self.active, self.retries_in_flight, attempt, self.pcfg, self.cfg.attempts_max,
                                     gone)[0]:
                        break
                    await asyncio.sleep(backoff_s(attempt, self.rng_policy))
                r = self._choose(tried)
                since_s = self.no_replica_since_s if self.no_replica_since_s is not None else self.now()
                while r is None and may_wait_for_replica(self.now(), since_s, self.cfg.outage_wait_s)[0]:
                    await asyncio.sleep(0.02)  # the router's choose_waiting: bounded by the outage's age
                    r = self._choose(tried)
                if r is None:
                    gone = True
                    await asyncio.sleep(0.05)
                    continue
                tried.add(r.stats.replica_id)
                self.retries += 1 if attempt else 0
                self.retries_in_flight += 1 if attempt else 0
                try:
                    await self._hedged(r, tried, moved)
                    self.latencies_s.append(self.now() - t0)
                    self.starts_s.append(t0 - self.t0_s)
                    self.history.add(self.now() - t0)
                    return
                except ReplicaGone as e:
                    gone, moved = e.replica_gone, moved or isinstance(e, Moved)
                finally:
                    self.retries_in_flight -= 1 if attempt else 0
            self.failed += 1
        finally:
            self.active -= 1

    # --- membership (the failure detector's heartbeat rule plus the progress rule) -----------------
    def _set_health(self, r: SimReplica, healthy: bool, reason: str) -> None:
        r.stats.healthy = healthy
        if healthy:
            r.ever_healthy = True
        else:
            r.good_polls = 0
            self._fail_pending(r)  # the router moves requests off a replica that left rotation
        self.detections.append({"t_s": round(self.now(), 3), "replica": r.stats.replica_id, "healthy": healthy,
                                "reason": reason})

    async def _membership(self, until_s: float) -> None:
        cfg = self.cfg.detector
        while self.now() < until_s:
            now = self.now()
            for r in self.reps:
                answers = r.alive and r.frozen_until_s <= now and r.partition_until_s <= now
                r.last_heartbeat_s = now if answers else r.last_heartbeat_s
                r.good_polls = r.good_polls + 1 if answers else 0
                if r.alive and r.frozen_until_s <= now and r.hung_until_s <= now:
                    r.last_progress_s = now
            live = {r.stats.replica_id: Liveness(r.alive and r.good_polls > 0, r.last_heartbeat_s) for r in self.reps}
            suspects = {s.worker_id: s.reason for s in heartbeat_suspects(now, live, cfg)}
            for r in self.reps:
                busy = r.running > 0 or bool(r.queue)
                if busy and now - r.last_progress_s > self.cfg.progress_timeout_s:
                    suspects.setdefault(r.stats.replica_id, "no progress with work queued")
                if r.stats.replica_id in suspects and r.stats.healthy:
                    self._set_health(r, False, suspects[r.stats.replica_id])
                elif r.stats.replica_id not in suspects and not r.stats.healthy and r.good_polls >= 3:
                    self._set_health(r, True, "heartbeats and progress")
            if any(r.stats.healthy for r in self.reps):
                self.no_replica_since_s = None
            elif self.no_replica_since_s is None:
                self.no_replica_since_s = now
            ejected_now: set[str] = set()
            for s, _ in latency_outliers(now, [r.stats for r in self.reps], self.pcfg):
                s.ejected_until_s = now + self.pcfg.ejection_s
                ejected_now.add(s.replica_id)
                self._move_held(self.by_id[s.replica_id])
            if self.pcfg.ejection_moves_later:  # the router's later moves: what stayed is re-decided every tick
                for r in self.reps:
                    if r.stats.ejected_until_s > now and r.stats.replica_id not in ejected_now and r.held:
                        self._move_held(r)
            await asyncio.sleep(cfg.heartbeat_interval_s)

    # --- faults and the run ----------------------------------------------------------------------
    async def _faults(self) -> None:
        for f in sorted(self.faults, key=lambda f: (f.at_s, f.line)):
            await asyncio.sleep(max(0.0, self.t0_s + f.at_s - self.now()))
            if not 0 <= f.replica < len(self.reps):
                continue
            r, until = self.reps[f.replica], self.now() + (f.for_s if f.for_s else 1e9)
            params = dict(f.params)
            if f.kind == "kill":
                r.alive = False
                self._fail_pending(r)  # their connections reset
                if f.restart:  # a fresh process, up after RESTART_S (re-admitted after 3 good polls)
                    asyncio.get_running_loop().call_later(RESTART_S, setattr, r, "alive", True)
            elif f.kind in ("freeze", "hang", "partition"):
                setattr(r, {"freeze": "frozen_until_s", "hang": "hung_until_s", "partition": "partition_until_s"}[f.kind],
                        until)
            elif f.kind == "straggler":
                r.factor = f.factor
            elif f.kind == "latency":
                r.latency_s = float(params.get("mean_ms", 0.0)) / 1000
            elif f.kind == "loss":
                r.loss_probability = float(params.get("probability", 0.0))

    async def run(self) -> dict[str, Any]:
        self.by_id = {r.stats.replica_id: r for r in self.reps}
        for r in self.reps:
            r.stats.healthy = r.ever_healthy = True
        tasks = [asyncio.ensure_future(self._membership(self.cfg.duration_s + 60 + self._warmup_end_s()))]
        if self.cfg.warmup_arrivals_s:  # the router learns the replicas first; counts restart afterwards
            await self._arrive(self.cfg.warmup_arrivals_s)
            self.latencies_s, self.starts_s = [], []
            self.failed = self.retries = self.hedges = self.requests = self.moves = 0
            for r in self.reps:
                r.served = 0
        self.t0_s = self.now()
        tasks.append(asyncio.ensure_future(self._faults()))  # fault times count from the measured part's start
        await self._arrive(self.cfg.arrivals_s if self.cfg.arrivals_s is not None else self._poisson_s())
        for task in tasks:
            task.cancel()
        return self.summary()

    def _poisson_s(self) -> list[float]:
        arrivals = random.Random(f"arrivals:{self.cfg.seed}")
        out, t = [], arrivals.expovariate(self.cfg.rate_per_s)
        while t < self.cfg.duration_s:
            out.append(t)
            t += arrivals.expovariate(self.cfg.rate_per_s)
        return out

    def _warmup_end_s(self) -> float:
        return max(self.cfg.warmup_arrivals_s, default=0.0) + 60.0 if self.cfg.warmup_arrivals_s else 0.0

    async def _arrive(self, offsets_s: tuple[float, ...] | list[float]) -> None:
        """Send a request at each offset from now, then wait (at most 60 virtual s) for their answers."""
        start_s = self.now()
        requests: set[asyncio.Future[None]] = set()
        for offset_s in offsets_s:
            await asyncio.sleep(max(0.0, start_s + offset_s - self.now()))
            fut = asyncio.ensure_future(self._request())
            requests.add(fut)
            fut.add_done_callback(requests.discard)
        if requests:
            await asyncio.wait(set(requests), timeout=60.0)

    def summary(self) -> dict[str, Any]:
        lat = self.latencies_s
        return {"policy": self.cfg.policy.value + ("+hedge" if self.cfg.hedging else ""), "seed": self.cfg.seed,
                "replicas": self.cfg.replicas, "rate_per_s": self.cfg.rate_per_s, "requests": self.requests,
                "ok": len(lat), "failed": self.failed, "retries": self.retries, "hedges": self.hedges,
                "moves": self.moves,
                "unfinished": self.requests - len(lat) - self.failed,  # still waiting 60 virtual s after the last
                "served": sum(r.served for r in self.reps),
                "latency_s": {k: None if quantile(lat, q) is None else round(quantile(lat, q) or 0.0, 6)
                              for k, q in (("p50", 0.5), ("p99", 0.99), ("p99.9", 0.999))},
                "membership": self.detections[:200]}


POLICY_CASES = [(p, hedging) for p, hedging, _ in POLICY_NAMES.values()]  # every named policy, in that order


def simulate(cfg: SimServeConfig, faults: list[ServingFault]) -> Any:
    """The coroutine of one run; await it on a virtual-time loop (``sim.loop.VirtualTimeLoop``)."""
    return ServeSim(cfg, faults).run()
