"""An abandoned group's native threads are found and put below everything (group_teardown.py)."""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time

import pytest

from phalanx.collectives.group_teardown import lower_priority, native_threads, threads_since

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")


def _names(tids: set[int]) -> list[str]:
    return sorted(native_threads()[t] for t in tids if t in native_threads())


def test_the_threads_a_gloo_constructor_starts_are_found_and_lowered() -> None:
    import torch.distributed as dist

    before = native_threads()
    assert threading.get_native_id() in before
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=5))
    found = threads_since(before)
    assert threading.get_native_id() not in found
    deadline = time.monotonic() + 5
    # each thread names itself once running, the loop thread too, and Gloo's work threads one by
    # one: wait until every thread the constructor started has (one still unnamed when the group's
    # threads are counted below, and named by the time they are lowered, was a race of this test)
    while (not all(n.startswith(("gloo", "pt_gloo")) for n in _names(found)) or len(_names(found)) < len(found)) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "gloo_tcp_loop" in _names(found) and "pt_gloo_runloop" in _names(found), _names(found)
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    group_named = {t for t in found if native_threads().get(t, "").startswith(("gloo", "pt_gloo"))}
    assert lower_priority(found) == len(group_named) >= 2  # others started meanwhile are not touched
    assert all(os.getpriority(os.PRIO_PROCESS, tid) == 19 for tid in group_named)
    assert lower_priority(found) == 0  # already there
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # the caller keeps its own
    del pg


def test_a_thread_that_is_not_a_groups_is_left_alone() -> None:
    started = threading.Event()
    stop = threading.Event()
    before = native_threads()
    t = threading.Thread(target=lambda: (started.set(), stop.wait(10)), name="users-own")
    t.start()
    started.wait(5)
    try:
        mine = threads_since(before)
        assert t.native_id in mine  # started meanwhile, as a user's thread could be
        assert lower_priority(mine | {2**22 + 12345}) == 0  # not a group's name; no such thread
        assert os.getpriority(os.PRIO_PROCESS, t.native_id) == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    finally:
        stop.set()
        t.join()
