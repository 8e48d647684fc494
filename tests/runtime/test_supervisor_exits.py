"""The launcher sleeps until a worker exits instead of polling every 50 ms: a real process's exit
wakes the supervisor's wait at once (a pidfd on the event loop), a restarted process is watched
again, and nothing stays registered after stop_all."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from phalanx.core import event_loop
from phalanx.runtime.supervisor import Supervisor

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfd on this platform")


def _sup(tmp_path, sleep_s: float, count: int = 1) -> Supervisor:
    return Supervisor([sys.executable, "-c", f"import time; time.sleep({sleep_s})"], dict(os.environ), tmp_path,
                      count, restart_failed=False)


def test_an_exit_wakes_the_wait_at_once_and_a_restart_is_watched_again(tmp_path):
    async def main():
        sup = _sup(tmp_path, 0.3)
        sup.start_all()
        assert sup.watch_exits()
        woke = []
        for _ in range(2):
            t0 = time.monotonic()
            await sup.wait(10.0)
            woke.append(time.monotonic() - t0)
            exited = []
            while not exited:  # the pidfd is readable once the process is gone: poll() reaps it
                exited = sup.poll()
            assert [(w.worker_id, code) for w, code in exited] == [("w0", 0)]
            if len(woke) == 1:
                sup.restart(sup.workers[0])
        watched = dict(sup._pidfds)
        sup.stop_all()
        return woke, watched, sup._pidfds

    woke, watched, left = event_loop.run(main())
    assert all(w < 5.0 for w in woke), f"waited {woke} s for exits 0.3 s away"
    assert watched == {} and left == {}  # a reaped process is no longer watched


def test_a_wait_with_no_exit_returns_at_its_timeout_and_wake_cuts_it_short(tmp_path):
    async def main():
        sup = _sup(tmp_path, 30.0)
        sup.start_all()
        sup.watch_exits()
        t0 = time.monotonic()
        await sup.wait(0.2)
        timed_out = time.monotonic() - t0
        asyncio.get_running_loop().call_later(0.05, sup.wake)
        t0 = time.monotonic()
        await sup.wait(10.0)
        woken = time.monotonic() - t0
        sup.stop_all()
        return timed_out, woken, sup.poll()

    timed_out, woken, _ = event_loop.run(main())
    assert 0.15 < timed_out < 5.0
    assert woken < 5.0
