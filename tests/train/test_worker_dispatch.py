"""How the worker agent takes grants: an epoch's member list arrives once; a later grant of the same
epoch says [] and means the same members; [] for an epoch it never heard of closes the connection
(it reconnects and is sent full lists); a stale epoch's grant is ignored."""

import asyncio
import random

from phalanx.core.messages import QuorumAssigned
from phalanx.sim.loop import run_virtual
from phalanx.train.worker_agent import WorkerAgent, WorkerConfig


class _Host:
    rng = random.Random(0)

    def now(self):
        return asyncio.get_running_loop().time()

    def log(self, event, **fields):
        pass


class _Conn:
    closed_because = ""

    def close(self, reason="closed"):
        self.closed_because = reason


def test_grants_reuse_the_epochs_member_list_and_an_unknown_empty_one_drops_the_connection():
    async def main():
        agent = WorkerAgent(_Host(), WorkerConfig("w1", "c:1"), pg_factory=None)
        agent._conn = conn = _Conn()
        agent._dispatch(QuorumAssigned(step=0, quorum_id=3, members=["w0", "w1"], rank=1))
        agent._dispatch(QuorumAssigned(step=1, quorum_id=3, members=[], rank=1))
        early, _ = agent._early
        assert (early.step, early.members, early.rank) == (1, ("w0", "w1"), 1) and not conn.closed_because
        agent._dispatch(QuorumAssigned(step=2, quorum_id=2, members=[], rank=0))  # stale epoch: ignored
        assert agent._early[0].step == 1 and not conn.closed_because
        agent._dispatch(QuorumAssigned(step=2, quorum_id=4, members=[], rank=0))
        assert "quorum 4 named no members" in conn.closed_because and agent._early[0].step == 1

    run_virtual(main())


class _Group:
    def __init__(self, quorum_id):
        self.quorum_id, self.abandoned = quorum_id, 0

    def abandon(self):
        self.abandoned += 1


def test_a_broken_quorums_group_is_given_up_when_the_coordinator_says_so_and_no_other():
    """Not when the body next touches it: a group whose peer died can spin a thread meanwhile."""
    from phalanx.core.messages import QuorumBroken

    async def main():
        agent = WorkerAgent(_Host(), WorkerConfig("w1", "c:1"), pg_factory=None)
        agent._conn = _Conn()
        agent._pg = group = _Group(3)
        agent._dispatch(QuorumBroken(quorum_id=2, reason="an older epoch"))
        assert agent._pg is group and group.abandoned == 0
        agent._dispatch(QuorumBroken(quorum_id=3, reason="w0 lost"))
        assert agent._pg is None and group.abandoned == 1
        assert agent._broken == {2: "an older epoch", 3: "w0 lost"}

    run_virtual(main())


class _SendConn(_Conn):
    is_closed = False

    def __init__(self):
        self.sent = []

    async def send(self, message):
        self.sent.append(message)


class _Stuck:
    """A collective whose peer died: it never completes on its own."""

    async def wait(self, timeout_s):
        await asyncio.sleep(3600)


class _StuckGroup(_Group):
    def start_allreduce_sum(self, tensor, share=1.0):
        return _Stuck()


def _vote(agent, quorum_id):
    from phalanx.train.exchange import Exchange
    from phalanx.train.worker_agent import Assignment

    a = Assignment(5, quorum_id, ("w0", "w1"), 1, "", "", (), "", False, (), 0, False)
    ex = Exchange(_StuckGroup(quorum_id))
    ex.launch(object())
    return asyncio.ensure_future(agent.allreduce(a, ex, None, lambda: (True, 0.0), 0.01, next_step=6))


def test_a_vote_on_a_quorum_the_coordinator_broke_is_an_abort_without_a_round_trip():
    """The coordinator breaks a quorum only when it aborts the quorum's step, and a step needs every
    member's report to commit: a member still voting knows the verdict, and reports nothing."""
    from phalanx.core.messages import AllreduceDone, QuorumBroken, StepDecision

    async def main():
        agent = WorkerAgent(_Host(), WorkerConfig("w1", "c:1"), pg_factory=None)
        agent._conn = conn = _SendConn()
        vote = _vote(agent, 3)  # waiting on its collective when the news arrives
        await asyncio.sleep(0.05)
        agent._dispatch(QuorumBroken(quorum_id=3, reason="w0 lost (connection lost)"))
        d = await vote
        assert (d.commit, d.step, d.quorum_id, d.reason) == (False, 5, 3, "w0 lost (connection lost)")
        assert conn.sent == [] and agent._decisions == {}
        d = await _vote(agent, 3)  # voting after the news: the same, at once
        assert not d.commit and conn.sent == []
        # an intact quorum's vote still reports, and waits for the verdict
        from phalanx.collectives.process_group import LocalProcessGroup
        from phalanx.train.exchange import Exchange
        from phalanx.train.worker_agent import Assignment

        a = Assignment(5, 4, ("w1",), 0, "", "", (), "", False, (), 0, False)
        vote = asyncio.ensure_future(agent.allreduce(a, Exchange(LocalProcessGroup(4)), None, lambda: (True, 0.0), 0.01))
        await asyncio.sleep(0.05)
        assert not vote.done() and [type(m) for m in conn.sent] == [AllreduceDone]
        agent._dispatch(StepDecision(step=5, quorum_id=4, commit=True, reason="ok"))
        assert (await vote).commit

    run_virtual(main())
