"""An aborted step's survivors are granted its redo in the abort's own frame, without asking.

Hand-driven workers on the simulated host (tests/membership/test_coordinator.py's harness): the
frame that tells a survivor its quorum broke also carries the next quorum's grant for the same step,
and no QuorumRequest is needed; where a member may not hold the step's starting state, nobody is
granted until each asks."""

import asyncio

from phalanx.core.messages import AllreduceDone, Bundle, QuorumAssigned, QuorumBroken, QuorumRequest, StepDecision
from phalanx.membership.quorum import QuorumConfig

from tests.membership.test_coordinator import _next, _run

THREE = QuorumConfig(expected_workers=3, join_timeout_s=0.5)


async def _commit_step_0(connect, workers):
    """Three workers form step 0's quorum and commit it (reports that do not ask for step 1)."""
    conns = {w: (await connect(w))[0] for w in workers}
    for c in conns.values():
        await c.send(QuorumRequest(step=0, last_committed_step=-1, has_state=False))
    grants = {w: await _next(c, QuorumAssigned) for w, c in conns.items()}
    for w, c in conns.items():
        await c.send(AllreduceDone(step=0, quorum_id=grants[w].quorum_id, ok=True, samples_covered_once=True))
    for c in conns.values():
        assert (await _next(c, StepDecision)).commit
    for c in conns.values():
        await c.send(QuorumRequest(step=1, last_committed_step=0, has_state=True))
    step1 = {w: await _next(c, QuorumAssigned) for w, c in conns.items()}
    return conns, step1


def test_a_lost_members_survivors_get_the_redo_grant_with_the_abort():
    async def scenario(coord, connect, loop):
        conns, step1 = await _commit_step_0(connect, ("w0", "w1", "w2"))
        q1 = step1["w0"].quorum_id
        conns["w1"].close("killed")  # w1 dies during step 1
        frames = {w: await _next(conns[w], Bundle) for w in ("w0", "w2")}
        return q1, frames, dict(coord.quorum_requests), (coord.quorum.members, coord.quorum.decided)

    q1, frames, requests, quorum = _run(scenario, quorum=THREE)
    for rank, (w, frame) in enumerate(sorted(frames.items())):
        broken, decision, grant = frame.items
        assert isinstance(broken, QuorumBroken) and broken.quorum_id == q1
        assert isinstance(decision, StepDecision) and not decision.commit and decision.step == 1
        assert isinstance(grant, QuorumAssigned)
        assert (grant.step, grant.rank, grant.members) == (1, rank, ["w0", "w2"])
        assert grant.quorum_id > q1
    assert requests["on_abort"] == 2
    assert quorum == (("w0", "w2"), False)  # formed, waiting for the redo's reports


def test_a_failed_report_aborts_and_the_same_members_are_granted_a_new_quorum_at_once():
    async def scenario(coord, connect, loop):
        conns, step1 = await _commit_step_0(connect, ("w0", "w1", "w2"))
        q1 = step1["w0"].quorum_id
        await conns["w0"].send(AllreduceDone(step=1, quorum_id=q1, ok=False, error="collective failed"))
        frames = [await _next(c, Bundle) for c in conns.values()]  # [broken, abort, grant] each
        return q1, [f.items[-1] for f in frames]

    q1, grants = _run(scenario, quorum=THREE)
    assert {g.quorum_id for g in grants} == {q1 + 1}
    assert [g.step for g in grants] == [1, 1, 1]


def test_no_redo_grant_while_a_member_may_lack_the_steps_starting_state():
    """Step 0's quorum: nobody has state yet (the first step heals or starts fresh); its abort
    leaves the survivors to ask, as before."""

    async def scenario(coord, connect, loop):
        conns = {w: (await connect(w))[0] for w in ("w0", "w1", "w2")}
        for c in conns.values():
            await c.send(QuorumRequest(step=0, last_committed_step=-1, has_state=False))
        first = [await _next(c, QuorumAssigned) for c in conns.values()]
        conns["w1"].close("killed")
        abort = await _next(conns["w0"], Bundle)  # [broken, abort decision]: no grant in it
        await asyncio.sleep(0.3)  # ticks run: nothing is granted without a request
        got_early = coord.quorum.quorum_id != first[0].quorum_id or \
            any(isinstance(m, QuorumAssigned) for m in abort.items)
        await conns["w0"].send(QuorumRequest(step=0, last_committed_step=-1, has_state=False))
        await conns["w2"].send(QuorumRequest(step=0, last_committed_step=-1, has_state=False))
        again = await _next(conns["w0"], QuorumAssigned)
        return got_early, dict(coord.quorum_requests), again

    got_early, requests, again = _run(scenario, quorum=THREE)
    assert not got_early
    assert requests["on_abort"] == 0
    assert again.step == 0 and again.members == ["w0", "w2"]
