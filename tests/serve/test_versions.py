"""Rollout decisions (pure): version ranks, per-session floors, which replicas a request may use, swap order."""

from __future__ import annotations

import asyncio

import pytest

from phalanx.serve.router import Router, RouterConfig, VersionHeldBack
from phalanx.serve.versions import (Consistency, ReplicaVersion, SessionVersions, VersionBook, excluded_for,
                                    next_to_swap, session_of)

OLD, NEW = "run/step_1", "run/step_2"


def test_versions_rank_in_rollout_order_and_unknown_ones_are_the_base():
    book = VersionBook()
    assert book.learn(OLD) == 0 and book.rank("never-seen") == 0
    assert book.promote(NEW) == 1 and book.rank(NEW) == 1
    assert book.promote(NEW) == 1  # promoting the newest again changes nothing
    assert book.promote(OLD) == 2  # a rollback rolled out later is the newest
    assert book.learn(NEW) == 1  # a replica seen serving a ranked version keeps its rank


def test_session_floor_only_rises_and_the_table_is_bounded_lru():
    s = SessionVersions(entries_max=2)
    s.observe("a", 2)
    s.observe("a", 1)
    assert s.floor("a") == 2 and s.floor(None) == 0 and s.floor("unknown") == 0
    s.observe("b", 1)
    s.floor("a")  # touch a: b is now the least recently used
    s.observe("c", 1)
    assert len(s) == 2 and s.floor("b") == 0 and s.floor("a") == 2


def test_session_is_the_header_else_the_user_field():
    assert session_of({"user": "u1"}, None) == "u1"
    assert session_of({"user": "u1"}, "h1") == "h1"
    assert session_of({"user": 3}, None) is None and session_of({}, "") is None
    assert len(session_of({}, "x" * 10_000) or "") == 256


@pytest.mark.parametrize("mode, floor, pinned, want", [
    (Consistency.CONSISTENT, 0, None, {"r1"}),  # r1 is draining for the rollout: nobody gets it
    (Consistency.CONSISTENT, 1, None, {"r1", "r2"}),  # a session that saw NEW never goes back to r2 (OLD)
    (Consistency.AVAILABLE, 1, None, {"r1"}),  # available: any admitting replica
    (Consistency.AVAILABLE, 0, OLD, {"r0"}),  # a resumed OLD stream continues on OLD only, draining r1 included
    (Consistency.CONSISTENT, 0, NEW, {"r1", "r2"}),
])
def test_requests_are_kept_off_draining_and_older_replicas(mode, floor, pinned, want):
    reps = [ReplicaVersion("r0", NEW, 1, True), ReplicaVersion("r1", OLD, 0, False), ReplicaVersion("r2", OLD, 0, True)]
    got, why = excluded_for(reps, mode, floor, pinned)
    assert got == frozenset(want) and why


def test_rollout_swaps_in_id_order_skips_replicas_out_of_rotation_and_stops_when_all_are_done():
    reps = [("r1", OLD, True), ("r0", NEW, True), ("r2", OLD, False), ("r3", OLD, True)]
    assert next_to_swap(reps, NEW, frozenset())[:2] == ("r1", True)
    assert next_to_swap(reps, NEW, frozenset({"r1"}))[:2] == ("r2", False)  # out of rotation: skipped
    assert next_to_swap(reps, NEW, frozenset({"r1", "r2"}))[:2] == ("r3", True)
    assert next_to_swap(reps, NEW, frozenset({"r1", "r2", "r3"}))[:2] == (None, False)


def _router(consistency: Consistency) -> Router:
    r = Router({"r0": "http://127.0.0.1:9", "r1": "http://127.0.0.1:9"},
               RouterConfig(consistency=consistency, version_wait_s=0.1))
    for rid, version in (("r0", NEW), ("r1", OLD)):
        r.replicas[rid].stats.healthy, r.replicas[rid].version = True, version
        r.book.learn(version)
    r.book.promote(NEW)
    return r


def test_router_in_consistent_mode_never_sends_a_session_back_to_an_older_version():
    r = _router(Consistency.CONSISTENT)
    r.observe_version("s", NEW)
    assert {r._choose(frozenset(), "s").stats.replica_id for _ in range(50)} == {"r0"}
    assert {r._choose(frozenset(), "fresh").stats.replica_id for _ in range(50)} == {"r0", "r1"}
    r.replicas["r0"].admitting = False  # the only NEW replica is being swapped: the session waits, then 503
    with pytest.raises(VersionHeldBack):
        asyncio.run(r.choose_waiting(frozenset(), "s"))
    assert r.metrics.version_refusals._value.get() == 1


def test_router_in_available_mode_lets_a_session_see_an_older_version():
    r = _router(Consistency.AVAILABLE)
    r.observe_version("s", NEW)
    assert {r._choose(frozenset(), "s").stats.replica_id for _ in range(50)} == {"r0", "r1"}


def test_a_resumed_stream_goes_only_to_a_replica_of_its_version_even_one_draining_for_the_rollout():
    r = _router(Consistency.AVAILABLE)
    r.replicas["r1"].admitting = False  # r1 (OLD) is being drained: no new requests ...
    assert {r._choose(frozenset(), None).stats.replica_id for _ in range(20)} == {"r0"}
    # ... but a stream that began on OLD weights continues there, never on NEW ones
    assert {r._choose(frozenset(), None, pinned=OLD).stats.replica_id for _ in range(20)} == {"r1"}
    r.replicas["r1"].stats.healthy = False  # and when no replica serves OLD any more, it is held back, not moved
    with pytest.raises(VersionHeldBack):
        r._choose(frozenset(), None, pinned=OLD)
