"""Router decisions as pure functions of (now, state, config, rng): which replica, retry, hedge, eject.

No clock, socket or global randomness here: the router driver (and later the simulator) passes
``now`` and a seeded ``random.Random``. Each decision returns a human-readable reason.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from enum import Enum


class Policy(str, Enum):
    P2C_LATENCY = "p2c-latency"  # two random candidates, fewer (outstanding + 1) x EWMA latency wins
    P2C_QUEUE = "p2c-queue"  # two random candidates, fewer outstanding wins (what Ray Serve does)
    ROUND_ROBIN = "round-robin"


# The policies by name, one spelling for `phalanx serve --policy`, `phalanx sim serve --policy`, the router process
# and the benchmark's cases: name -> (choice, hedging, what it does).
POLICY_NAMES: dict[str, tuple[Policy, bool, str]] = {
    "round-robin": (Policy.ROUND_ROBIN, False, "each healthy replica in turn"),
    "p2c-queue": (Policy.P2C_QUEUE, False, "two random replicas, the one with fewer requests outstanding "
                  "(what Ray Serve does)"),
    "p2c-latency": (Policy.P2C_LATENCY, False, "two random replicas, the lower (outstanding + 1) x latency "
                    "EWMA"),
    "p2c-latency+hedge": (Policy.P2C_LATENCY, True, "p2c-latency, and a unary request still unanswered after the "
                          "rolling p95 gets a second copy on a replica expected to answer first (10 % budget; the "
                          "loser is cancelled)"),
}


def parse_policy(name: str) -> tuple[Policy, bool]:
    """A policy name (``POLICY_NAMES``) -> (choice, hedging). ValueError names the known ones."""
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
    policy, hedging, _ = POLICY_NAMES[name]
    return policy, hedging


def policy_help(extra: str = "") -> str:
    """The --policy help text every command shows (escaped for argparse, which %-formats help)."""
    return ("; ".join(f"{n}: {what}" for n, (_, _, what) in POLICY_NAMES.items()) + extra).replace("%", "%%")


class HedgeRule(str, Enum):
    EXPECTED_FIRST = "expected-first"  # only to a replica expected to answer before the primary (hedge_target)
    ANY_AFTER_P95 = "any-after-p95"  # to the cheapest other replica, whatever its queue (the rule before session 12)


@dataclass(frozen=True)
class PolicyConfig:
    policy: Policy = Policy.P2C_LATENCY
    ewma_alpha: float = 0.3
    retry_budget_ratio: float = 0.2  # retries in flight at most this fraction of active requests (Envoy's 20 %)
    retry_budget_min: int = 3  # ... but always allow this many
    hedge_budget_ratio: float = 0.1  # hedges at most 10 % extra requests
    hedge_quantile: float = 0.95
    hedge_min_samples: int = 20
    hedge_delay_min_s: float = 0.005
    ejection_consecutive_failures: int = 5
    ejection_s: float = 2.0
    outlier_latency_ratio: float = 5.0  # EWMA this many times the median of the others: passive ejection (0: off)
    outlier_min_samples: int = 10
    p2c_choices: int = 2  # candidates drawn per choice (2: power of two choices)
    hedge_rule: HedgeRule = HedgeRule.EXPECTED_FIRST
    # an ejected replica's requests that have produced no output yet move elsewhere (held_to_move); each request
    # moves at most once, at most max(min, ratio x active) per ejection, and only where it is expected to finish first
    ejection_moves: bool = True
    # ... and again at every membership tick while it stays ejected, for the requests that stayed (a request that
    # has waited past its estimate is then expected to owe as long again; the others may have drained): in the
    # simulator, round-robin's p99 with one 10x replica fell 30-50 %, P2C x latency's was unchanged (SERVING.md,
    # "Session 15")
    ejection_moves_later: bool = True
    move_budget_ratio: float = 0.5
    move_budget_min: int = 4


@dataclass
class ReplicaStats:
    """The router's view of one replica (mutated by the driver, read by the decisions)."""

    replica_id: str
    healthy: bool = False  # admitted by membership (heartbeat + progress)
    outstanding: int = 0
    ewma_latency_s: float = 0.0
    samples: int = 0
    consecutive_failures: int = 0
    ejected_until_s: float = 0.0
    inflight_since_s: list[float] = field(default_factory=list)  # start times of unary attempts in flight

    def observe(self, latency_s: float, alpha: float, ahead: int = 0, size: float = 1.0) -> None:
        """``ahead``: requests this replica already had when the measured one was sent. The EWMA keeps the time
        per request (latency / (ahead + 1)), so the cost (outstanding + 1) x EWMA counts the queue once.
        ``size``: the request's tokens over the fleet's typical tokens per request (``RequestSizes``), so a long
        answer or stream teaches the time a typical request takes there, not its own length."""
        latency_s = latency_s / (ahead + 1) / (size if size > 0 else 1.0)
        self.ewma_latency_s = latency_s if self.samples == 0 else (1 - alpha) * self.ewma_latency_s + alpha * latency_s
        self.samples += 1
        self.consecutive_failures = 0


@dataclass
class RequestSizes:
    """The fleet's typical tokens generated per request (an EWMA over every answer, unary or streamed).

    Why: the latency EWMA compares replicas (P2C, outlier ejection), so each observation must be in one unit
    whatever the request: a whole stream of 500 tokens on a healthy replica is not slow, and neither is a
    unary answer next to a stream's first token (what streams taught before session 13: two scales in one
    EWMA, so a replica fed unary requests looked 5-20x slower than stream-fed ones). Each answer teaches its
    time per request scaled to the typical size; with requests of one size this is 1 and changes nothing."""

    alpha: float = 0.05
    typical_tokens: float = 0.0

    def size(self, tokens: int | None) -> float:
        """``tokens`` relative to the typical request (1.0 while unknown), after counting it in the typical."""
        if not tokens or tokens <= 0:
            return 1.0
        self.typical_tokens = (float(tokens) if self.typical_tokens == 0.0
                               else (1 - self.alpha) * self.typical_tokens + self.alpha * tokens)
        return tokens / self.typical_tokens


def eligible(now: float, replicas: list[ReplicaStats], exclude: frozenset[str] = frozenset()) -> list[ReplicaStats]:
    return sorted((r for r in replicas if r.healthy and r.ejected_until_s <= now and r.replica_id not in exclude),
                  key=lambda r: r.replica_id)


def _cost(r: ReplicaStats, typical_s: float, now: float, extra: int = 0) -> float:
    """(outstanding + ``extra`` + 1) x expected latency, where a request already in flight longer than the EWMA
    raises the estimate at once (as Finagle's peak EWMA does): a replica that turned slow, or that was
    never measured, stops attracting requests before its first slow answer comes back."""
    expected_s = r.ewma_latency_s if r.samples else typical_s
    if r.inflight_since_s:
        expected_s = max(expected_s, now - min(r.inflight_since_s))
    return (r.outstanding + extra + 1) * expected_s


def choose_replica(now: float, replicas: list[ReplicaStats], cfg: PolicyConfig, rng: random.Random, rr_index: int,
                   exclude: frozenset[str] = frozenset()) -> tuple[ReplicaStats | None, str]:
    cands = eligible(now, replicas, exclude)
    if not cands:
        # Every healthy replica left is ejected: ejection is a preference, not a verdict (Envoy's panic
        # routing), and a slow or failing replica still beats refusing the request with a 503.
        cands = sorted((r for r in replicas if r.healthy and r.replica_id not in exclude), key=lambda r: r.replica_id)
    if not cands:
        return None, "no healthy replica outside " + (",".join(sorted(exclude)) or "the ejected set")
    if cfg.policy is Policy.ROUND_ROBIN:
        r = cands[rr_index % len(cands)]
        return r, f"round-robin slot {rr_index % len(cands)}"
    if len(cands) == 1:
        return cands[0], "only candidate"
    drawn = rng.sample(cands, min(len(cands), max(2, cfg.p2c_choices)))
    if cfg.policy is Policy.P2C_QUEUE:
        a, b = drawn[:2]
        pick = a if (a.outstanding, a.replica_id) <= (b.outstanding, b.replica_id) else b
        return pick, f"p2c-queue {a.replica_id}={a.outstanding} vs {b.replica_id}={b.outstanding}"
    typical = typical_latency_s(cands)
    costs = [(_cost(r, typical, now), r.outstanding) for r in drawn]
    pick = drawn[costs.index(min(costs))]  # a tie goes to the first drawn: random, so an unmeasured replica gets tried
    return pick, "p2c-latency " + " vs ".join(f"{r.replica_id}={c:.4f}" for r, (c, _) in zip(drawn, costs))


def typical_latency_s(cands: list[ReplicaStats]) -> float:
    known = sorted(r.ewma_latency_s for r in cands if r.samples)
    return known[len(known) // 2] if known else 0.0  # an unmeasured replica costs the median


def hedge_target(now: float, replicas: list[ReplicaStats], primary: ReplicaStats, ahead: int, elapsed_s: float,
                 cfg: PolicyConfig, exclude: frozenset[str] = frozenset()) -> tuple[ReplicaStats | None, str]:
    """Where a second copy of a request that has waited ``elapsed_s`` on ``primary`` should go, if anywhere.

    A hedge adds a request's work to a replica, so it only goes where it is expected to finish before
    the primary: the cheapest other replica by (outstanding + 1) x EWMA, and only if that beats what
    the primary still owes (its time per request x (``ahead`` + 1), less what has elapsed; a request
    already past that is assumed to need as long again). On a busy fleet this sends no hedge to a queue
    that would finish later anyway (hedges there only add load), while a request stuck behind a slow
    replica moves to a fast one with room."""
    cands = [r for r in eligible(now, replicas, exclude) if r.replica_id != primary.replica_id]
    if not cands:
        return None, "no other replica to hedge to"
    typical = typical_latency_s(cands + [primary])
    target = min(cands, key=lambda r: (_cost(r, typical, now), r.outstanding, r.replica_id))
    target_s = _cost(target, typical, now)
    if cfg.hedge_rule is HedgeRule.ANY_AFTER_P95:
        return target, f"hedge to {target.replica_id} ({target_s:.3f} s expected)"
    per_request_s = primary.ewma_latency_s if primary.samples else typical
    owed_s = per_request_s * (ahead + 1) - elapsed_s
    remaining_s = owed_s if owed_s > 0 else elapsed_s
    if target_s < remaining_s:
        return target, f"hedge to {target.replica_id}: {target_s:.3f} s expected < {remaining_s:.3f} s left on {primary.replica_id}"
    return None, f"no hedge: best other {target.replica_id} {target_s:.3f} s >= {remaining_s:.3f} s left on {primary.replica_id}"


@dataclass(frozen=True)
class HeldRequest:
    """A request an ejected replica holds that has produced no output yet: a unary attempt, or a stream
    before its first token. ``moved_before``: it already moved once (it will not move again)."""

    key: int
    started_s: float
    moved_before: bool = False


def held_to_move(now: float, ejected: ReplicaStats, held: list[HeldRequest], replicas: list[ReplicaStats],
                 cfg: PolicyConfig, active: int) -> list[tuple[int, str]]:
    """Which requests still waiting on a replica just ejected move elsewhere (cancelled there, sent again).

    The replica serves its requests in arrival order, so the one at position i (oldest first) still owes
    its time per request x (i + 1) less what it has waited (past that: as long again, as ``hedge_target``
    assumes). From the back of the queue, which owes most, a request moves when the cheapest other replica,
    counting the moves already decided, is expected to finish it sooner. Bounded so an ejection cannot turn
    into a retry storm: each request moves at most once, at most max(``move_budget_min``,
    ``move_budget_ratio`` x active) per ejection, and a moved request adds no work (its old attempt is
    cancelled). A stream that has already sent tokens is not held: it keeps its slot (see docs/SERVING.md)."""
    if not cfg.ejection_moves or not held:
        return []
    cands = eligible(now, replicas, frozenset({ejected.replica_id}))
    if not cands:
        return []
    budget = max(cfg.move_budget_min, int(cfg.move_budget_ratio * active))
    typical = typical_latency_s(cands + [ejected])
    per_request_s = ejected.ewma_latency_s if ejected.samples else typical
    extra = {r.replica_id: 0 for r in cands}
    order = sorted(held, key=lambda h: (h.started_s, h.key))
    moves: list[tuple[int, str]] = []
    for pos in reversed(range(len(order))):  # bounded by the held requests and the budget
        h = order[pos]
        if h.moved_before:
            continue
        if len(moves) >= budget:
            break
        waited_s = now - h.started_s
        owed_s = per_request_s * (pos + 1) - waited_s
        remaining_s = owed_s if owed_s > 0 else waited_s
        target = min(cands, key=lambda r: (_cost(r, typical, now, extra[r.replica_id]), r.outstanding, r.replica_id))
        target_s = _cost(target, typical, now, extra[target.replica_id])
        if target_s < remaining_s:
            extra[target.replica_id] += 1
            moves.append((h.key, f"move from {ejected.replica_id} (position {pos}): {remaining_s:.3f} s left there > "
                                 f"{target_s:.3f} s on {target.replica_id}"))
    return moves


def may_wait_for_replica(now: float, no_replica_since_s: float, wait_s: float) -> tuple[bool, str]:
    """No replica is in rotation: does a request wait for one, or get its 503 now? It waits while the outage is
    younger than ``wait_s``: every replica out at once is most often a blip (a starved box where every replica
    missed its polls; a replica re-admitted after three good polls), and a short wait turns it into latency
    instead of errors. A longer outage answers at once: requests do not pile up behind replicas that are gone
    (admission control bounds those that wait meanwhile)."""
    age_s = now - no_replica_since_s
    if age_s < wait_s:
        return True, f"no replica in rotation for {age_s:.2f} s (< {wait_s} s): wait for one"
    return False, f"no replica in rotation for {age_s:.2f} s (>= {wait_s} s): answer 503"


def may_retry(active: int, retries_in_flight: int, attempt: int, cfg: PolicyConfig, attempts_max: int = 3,
              replica_gone: bool = False) -> tuple[bool, str]:
    """The budget stops retries from multiplying an overload; a request whose replica died (connection
    refused or dropped before any answer) adds no load by moving, so only ``attempts_max`` bounds it."""
    if attempt >= attempts_max:
        return False, f"attempt {attempt} reached the maximum of {attempts_max}"
    if replica_gone:
        return True, f"retry {attempt}: the replica is gone (outside the budget)"
    budget = max(cfg.retry_budget_min, int(cfg.retry_budget_ratio * active))
    if retries_in_flight >= budget:
        return False, f"retry budget spent ({retries_in_flight} in flight, budget {budget})"
    return True, f"retry {attempt} within budget {budget}"


def backoff_s(attempt: int, rng: random.Random, base_s: float = 0.005, cap_s: float = 0.1) -> float:
    """Full-jitter exponential backoff (small: the next try goes to a different replica)."""
    return rng.uniform(0.0, min(cap_s, base_s * (2 ** attempt)))


@dataclass
class RollingLatency:
    """The last ``window`` latencies of a request class; its quantile is the hedge delay."""

    window: int = 500
    values: deque[float] = field(default_factory=deque)

    def add(self, latency_s: float) -> None:
        self.values.append(latency_s)
        if len(self.values) > self.window:
            self.values.popleft()

    def quantile(self, q: float) -> float | None:
        if not self.values:
            return None
        s = sorted(self.values)
        return s[min(len(s) - 1, int(q * len(s)))]


def hedge_delay_s(history: RollingLatency, cfg: PolicyConfig) -> float | None:
    """When to send a second copy of a request (None: do not hedge yet, too few samples)."""
    if len(history.values) < cfg.hedge_min_samples:
        return None
    q = history.quantile(cfg.hedge_quantile)
    return None if q is None else max(cfg.hedge_delay_min_s, q)


def may_hedge(requests_total: int, hedges_total: int, cfg: PolicyConfig) -> tuple[bool, str]:
    budget = cfg.hedge_budget_ratio * max(requests_total, 1)
    if hedges_total + 1 > budget:
        return False, f"hedge budget spent ({hedges_total} of {budget:.0f})"
    return True, f"hedge {hedges_total + 1} within budget {budget:.0f}"


def after_failure(now: float, r: ReplicaStats, cfg: PolicyConfig) -> tuple[bool, str]:
    """Count a failed attempt; eject after ``ejection_consecutive_failures`` in a row (Envoy's rule)."""
    r.consecutive_failures += 1
    if r.consecutive_failures >= cfg.ejection_consecutive_failures:
        r.ejected_until_s = now + cfg.ejection_s
        r.consecutive_failures = 0
        return True, f"{cfg.ejection_consecutive_failures} consecutive failures: ejected for {cfg.ejection_s} s"
    return False, f"{r.consecutive_failures} consecutive failures"


def latency_outliers(now: float, replicas: list[ReplicaStats], cfg: PolicyConfig) -> list[tuple[ReplicaStats, str]]:
    """Passive ejection of a replica whose EWMA latency is far above the others' median (at most one at a time).
    A ratio of 0 turns it off: replicas leave rotation only through membership and consecutive failures."""
    if cfg.outlier_latency_ratio <= 0:
        return []
    live = [r for r in eligible(now, replicas) if r.samples >= cfg.outlier_min_samples]
    if len(live) < 3:
        return []
    worst = max(live, key=lambda r: (r.ewma_latency_s, r.replica_id))
    others = sorted(r.ewma_latency_s for r in live if r is not worst)
    median = others[len(others) // 2]
    if median > 0 and worst.ewma_latency_s > cfg.outlier_latency_ratio * median:
        return [(worst, f"EWMA {worst.ewma_latency_s:.3f} s > {cfg.outlier_latency_ratio}x median {median:.3f} s")]
    return []
