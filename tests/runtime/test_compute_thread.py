"""phalanx.join() puts the user's training thread below the control plane (runtime/worker_join.py):
nice +10 by default (PHALANX_COMPUTE_NICE), SCHED_BATCH on request (PHALANX_BATCH_SCHEDULING=1),
on that thread only; threads it starts later inherit it, threads started before keep theirs."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from phalanx.core.errors import ConfigError
from phalanx.runtime.worker_join import mark_compute_thread
from tests.runtime.helpers import in_thread

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@linux
def test_by_default_the_calling_thread_is_niced_and_no_other() -> None:
    mine = _nice()
    started_before = threading.Event()
    release = threading.Event()
    seen: dict[str, int] = {}

    def bystander() -> None:  # the control thread: started before, keeps its priority
        started_before.set()
        release.wait(10)
        seen["bystander"] = _nice()

    other = threading.Thread(target=bystander)
    other.start()
    started_before.wait(10)

    def mark() -> tuple[str, int, int, int]:
        before = _nice()
        done = mark_compute_thread({})
        return done, before, _nice(), in_thread(_nice)  # a thread started after inherits it

    done, before, after, child = in_thread(mark)
    release.set()
    other.join(10)
    assert after == min(before + 10, 19) and child == after
    assert done == f"nice {before} -> {after}"
    assert seen["bystander"] == mine and _nice() == mine  # the others, pytest's thread too, are untouched


@linux
def test_zero_leaves_it_alone_and_bad_settings_are_named() -> None:
    assert in_thread(lambda: (mark_compute_thread({"PHALANX_COMPUTE_NICE": "0"}), _nice())) == ("unchanged", _nice())
    for bad in ("20", "-5", "high"):
        with pytest.raises(ConfigError, match=f"PHALANX_COMPUTE_NICE='{bad}'"):
            mark_compute_thread({"PHALANX_COMPUTE_NICE": bad})
    with pytest.raises(ConfigError, match="PHALANX_BATCH_SCHEDULING='yes'"):
        mark_compute_thread({"PHALANX_BATCH_SCHEDULING": "yes", "PHALANX_COMPUTE_NICE": "0"})


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="no SCHED_BATCH on this OS")
def test_batch_scheduling_is_opt_in_and_inherited() -> None:
    before = os.sched_getscheduler(0)

    def mark() -> tuple[str, int, int]:
        done = mark_compute_thread({"PHALANX_BATCH_SCHEDULING": "1", "PHALANX_COMPUTE_NICE": "0"})
        child = in_thread(lambda: os.sched_getscheduler(0))  # started after: inherits it
        return done, os.sched_getscheduler(0), child

    assert in_thread(mark) == ("SCHED_BATCH", os.SCHED_BATCH, os.SCHED_BATCH)
    assert os.sched_getscheduler(0) == before  # this thread (pytest's) is untouched
    assert in_thread(lambda: (mark_compute_thread({"PHALANX_COMPUTE_NICE": "0"}), os.sched_getscheduler(0))) == \
        ("unchanged", before)
