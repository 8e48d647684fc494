"""The commit-decision deadline has no timer per step: the heartbeat loop gives up on a decision
that is overdue (PeerTimeout naming the step), and leaves one that is not alone."""

import asyncio
import random

import pytest

from phalanx.core.errors import PeerTimeout
from phalanx.sim.loop import run_virtual
from phalanx.train.worker_agent import WorkerAgent, WorkerConfig


class _Host:
    rng = random.Random(0)

    def now(self):
        return asyncio.get_running_loop().time()


def test_an_overdue_decision_fails_with_peer_timeout_and_a_pending_one_waits():
    async def main():
        agent = WorkerAgent(_Host(), WorkerConfig("w0", "c:1", decision_timeout_s=60.0), pg_factory=None)
        loop = asyncio.get_running_loop()
        late, fresh = loop.create_future(), loop.create_future()
        agent._decisions.update({(4, 2): late, (5, 2): fresh})
        agent._decision_due_s.update({(4, 2): 60.0, (5, 2): 90.0})
        agent._expire_decisions(59.9)
        assert not late.done() and not fresh.done()
        agent._expire_decisions(60.0)
        with pytest.raises(PeerTimeout, match="no commit decision for step 4 within 60 s"):
            late.result()
        assert not fresh.done()
        fresh.cancel()

    run_virtual(main())
