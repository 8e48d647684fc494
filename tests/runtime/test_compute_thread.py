"""With PHALANX_BATCH_SCHEDULING=1, phalanx.join() marks the user's training thread SCHED_BATCH
(runtime/worker_join.py), and only it; by default nothing changes."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from phalanx.core.errors import ConfigError
from phalanx.runtime.worker_join import mark_compute_thread

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="no SCHED_BATCH on this OS")


def _in_thread(fn: Any) -> Any:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except Exception as e:  # handed back to the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_the_calling_thread_becomes_batch_and_the_others_keep_their_policy() -> None:
    before = os.sched_getscheduler(0)

    def mark() -> tuple[bool, int, int]:
        done = mark_compute_thread({"PHALANX_BATCH_SCHEDULING": "1"})
        child = _in_thread(lambda: os.sched_getscheduler(0))  # started after: inherits it
        return done, os.sched_getscheduler(0), child

    done, policy, child = _in_thread(mark)
    assert done and policy == os.SCHED_BATCH and child == os.SCHED_BATCH
    assert os.sched_getscheduler(0) == before  # this thread (pytest's) is untouched


def test_it_is_off_by_default_and_a_bad_setting_is_named() -> None:
    for env in ({}, {"PHALANX_BATCH_SCHEDULING": "0"}):
        assert _in_thread(lambda: (mark_compute_thread(env), os.sched_getscheduler(0))) == \
            (False, os.sched_getscheduler(0))
    with pytest.raises(ConfigError, match="PHALANX_BATCH_SCHEDULING='yes'"):
        mark_compute_thread({"PHALANX_BATCH_SCHEDULING": "yes"})
