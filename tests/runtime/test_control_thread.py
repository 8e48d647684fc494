"""phalanx.join() runs its control thread SCHED_BATCH (runtime/worker_join.py): a wakeup there, or
in the Gloo threads of the groups it builds (they inherit the policy), takes no running thread's
core. ``PHALANX_CONTROL_BATCH=0`` leaves it alone; a bad value is named before any thread starts."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import pytest

from phalanx.core.errors import ConfigError
from phalanx.runtime.worker_join import control_batch, mark_control_thread
from tests.runtime.helpers import in_thread

batch_os = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="no SCHED_BATCH on this OS")


def test_the_setting_is_on_by_default_and_a_bad_value_is_named() -> None:
    assert control_batch({}) is True
    assert control_batch({"PHALANX_CONTROL_BATCH": "1"}) is True
    assert control_batch({"PHALANX_CONTROL_BATCH": "0"}) is False
    for bad in ("yes", "2", ""):
        with pytest.raises(ConfigError, match=f"PHALANX_CONTROL_BATCH='{bad}'"):
            control_batch({"PHALANX_CONTROL_BATCH": bad})


@batch_os
def test_the_control_thread_and_the_threads_it_starts_are_batch_and_no_other() -> None:
    mine = os.sched_getscheduler(0)

    def control() -> tuple[str, int, int]:
        done = mark_control_thread(True)
        return done, os.sched_getscheduler(0), in_thread(lambda: os.sched_getscheduler(0))

    assert in_thread(control) == ("SCHED_BATCH", os.SCHED_BATCH, os.SCHED_BATCH)
    assert os.sched_getscheduler(0) == mine  # pytest's thread is untouched
    assert in_thread(lambda: (mark_control_thread(False), os.sched_getscheduler(0))) == ("unchanged", mine)


@batch_os
def test_a_group_built_from_the_control_thread_runs_its_gloo_threads_batch() -> None:
    """The real path: each rank's loop runs on a marked control thread, and the factory builds the
    Gloo group on a thread started from it; the group's own threads wake without preempting."""
    import torch

    from phalanx.collectives.process_group import RendezvousStore, TorchProcessGroupFactory

    store = RendezvousStore("127.0.0.1")

    async def rank_main(rank: int) -> dict[int, int]:
        group: Any = await TorchProcessGroupFactory(store.address, b"t" * 32, run_id="batch").create(1, rank, 2, 30.0)
        t = torch.ones(1000)
        await group.allreduce_sum(t, 30.0)
        assert float(t[0]) == 2.0
        policies = {}
        for tid in group._threads:
            try:
                policies[tid] = os.sched_getscheduler(tid)
            except OSError:  # ended meanwhile
                pass
        group.abandon()
        return policies

    results: list[Any] = [None, None]

    def control(rank: int) -> None:
        mark_control_thread(True)
        results[rank] = asyncio.run(rank_main(rank))

    threads = [threading.Thread(target=control, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    mine = os.sched_getscheduler(0)
    for policies in results:
        assert policies, "the group's threads are known from its constructor"
        assert set(policies.values()) == {os.SCHED_BATCH}, policies
    assert mine != os.SCHED_BATCH  # the test's own thread never was
