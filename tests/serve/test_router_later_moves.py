"""Later moves: a request that stayed on an ejected replica (the others were busier at the moment of the ejection)
moves at a later membership tick once another replica would finish it sooner, and is counted once. The router's
own ``_decide_membership`` on hand-set state: no processes, no sockets, no wall clock."""

from __future__ import annotations

import dataclasses

from phalanx.serve.router import Router, RouterConfig
from phalanx.serve.routing_policy import PolicyConfig

NOW_S = 1000.0


def _router(later: bool) -> Router:
    cfg = RouterConfig(policy=dataclasses.replace(PolicyConfig(), ejection_moves_later=later))
    router = Router({"r0": "http://127.0.0.1:9", "r1": "http://127.0.0.1:9", "r2": "http://127.0.0.1:9"}, cfg)
    for r in router.replicas.values():  # every replica answering its polls: membership keeps them all
        r.connected, r.good_polls, r.last_heartbeat_s, r.ever_healthy = True, 5, NOW_S, True
        r.stats.healthy, r.stats.samples, r.stats.ewma_latency_s = True, 20, 0.1
    slow = router.replicas["r0"]
    slow.stats.ewma_latency_s, slow.stats.ejected_until_s = 1.0, NOW_S + 2.0  # ejected: 1 s per request
    slow.stats.outstanding = 1
    slow.held[7] = (NOW_S - 0.2, False)  # at the head of its queue: owes ~0.8 s there
    router.active = 1
    for rid in ("r1", "r2"):  # at the ejection both others are busy: 20 x 0.1 s ahead, so the request stays
        router.replicas[rid].stats.outstanding = 20
    return router


def _tick(router: Router, now_s: float) -> None:
    for r in router.replicas.values():
        r.last_heartbeat_s = now_s
    router._decide_membership(now_s)


def test_a_request_that_stayed_on_an_ejected_replica_moves_once_another_replica_has_drained():
    router = _router(later=True)
    slow = router.replicas["r0"]
    _tick(router, NOW_S)
    assert slow.move_keys == set() and router.moves_total == 0  # the others would finish it later
    router.replicas["r1"].stats.outstanding = 0  # r1 drained: 0.1 s there against ~0.7 s left on r0
    _tick(router, NOW_S + 0.1)
    assert slow.move_keys == {7} and router.moves_total == 1
    _tick(router, NOW_S + 0.2)  # marked, its attempt not yet gone: not moved (nor counted) twice
    assert slow.move_keys == {7} and router.moves_total == 1


def test_without_later_moves_what_stayed_at_the_ejection_stays():
    router = _router(later=False)
    _tick(router, NOW_S)
    router.replicas["r1"].stats.outstanding = 0
    _tick(router, NOW_S + 0.1)
    assert router.replicas["r0"].move_keys == set() and router.moves_total == 0


def test_a_replica_no_longer_ejected_keeps_its_requests():
    router = _router(later=True)
    slow = router.replicas["r0"].stats
    slow.ejected_until_s, slow.ewma_latency_s = NOW_S - 0.01, 0.4  # back in rotation, not an outlier (< 5 x 0.1 s)
    router.replicas["r1"].stats.outstanding = 0
    _tick(router, NOW_S)
    assert router.replicas["r0"].move_keys == set() and router.moves_total == 0
