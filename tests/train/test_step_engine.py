"""The step engine's table of what retries and what ends the job, driven through a scripted fake
agent (the engine's only way to the world besides its body and state seams), in virtual time."""

import pytest

from phalanx.core.errors import (
    CheckpointError, CollectiveError, CoordinatorLost, FinalStateUnavailable, HealError, JobFailed, JobOver,
    PeerTimeout,
)
from phalanx.core.messages import StepDecision, Welcome
from phalanx.collectives.process_group import LocalProcessGroup
from phalanx.sim.loop import run_virtual
from phalanx.train.exchange import Exchange
from phalanx.train.step_engine import MAX_ATTEMPTS_PER_STEP, BodyResult, StepEngine
from phalanx.train.worker_agent import Assignment


def _a(step, qid=1, **kw):
    base = dict(step=step, quorum_id=qid, members=("w0",), rank=0, heal_from="", heal_address="", heal_targets=(),
                restore_checkpoint="", write_checkpoint=False)
    return Assignment(**{**base, **kw})


class _Host:
    def now(self):
        import asyncio
        return asyncio.get_running_loop().time()


class _Cfg:
    worker_id = "w0"


class FakeAgent:
    """Answers wait_for_quorum from a script: an Assignment, or an exception to raise."""

    def __init__(self, script, mode="strict", vote_errors=(), reconnect_fails=False):
        self.script, self.vote_errors = list(script), list(vote_errors)
        self.host, self.cfg = _Host(), _Cfg()
        self.welcome = Welcome(run_id="r", store_address="s", heartbeat_interval_s=0.1, collective_timeout_s=1.0,
                               checkpoint_every_steps=0, run_dir="", mode=mode)
        self.last_committed_step, self.has_state, self.connected = -1, False, True
        self.calls: list[tuple] = []
        self.reconnect_fails = reconnect_fails

    async def wait_for_quorum(self, step, total, timeout_s=None):
        self.calls.append(("ask", step))
        item = self.script.pop(0) if self.script else PeerTimeout("script exhausted")
        if isinstance(item, Exception):
            raise item
        return item

    def take_grant(self, step, ready):
        return None

    def open_exchange(self, a, formed=None):
        return Exchange(LocalProcessGroup(a.quorum_id))

    async def allreduce(self, a, ex, tail, verify, compute_s, next_step=-1):
        if self.vote_errors:
            raise self.vote_errors.pop(0)
        return StepDecision(step=a.step, quorum_id=a.quorum_id, commit=True, reason="ok", loss=1.0)

    def committed(self, step):
        self.last_committed_step, self.has_state = step, True

    async def reconnect(self):
        self.calls.append(("reconnect",))
        if self.reconnect_fails:
            raise CoordinatorLost("unreachable for 30 s")

    async def goodbye(self, completed, reason):
        self.calls.append(("goodbye", completed))

    async def drain(self):
        self.calls.append(("drain",))

    def leave(self, reason):
        self.calls.append(("leave",))

    async def checkpoint_unusable(self, path, reason):
        self.calls.append(("unusable", path))

    async def checkpoint_written(self, step, path):
        self.calls.append(("written", step))

    async def heal(self, a):
        raise HealError("peer gone")


class Body:
    def __init__(self, engine_ref):
        self.ref, self.ran = engine_ref, []

    async def run(self, ticket):
        self.ran.append(ticket.step)
        v = await self.ref[0].vote(ticket.assignment, ticket.exchange, None, lambda: (True, 1.0), 0.01)
        return BodyResult(v.commit, 1, v.loss, v.reason)


class State:
    def __init__(self, restore_error=None):
        self.restore_error = restore_error

    async def restore_checkpoint(self, path):
        if self.restore_error:
            raise self.restore_error
        return 4

    async def write_checkpoint(self, step, a):
        return f"ck/{step}"


class Obs:
    def __init__(self):
        self.events = []

    def span(self, name, start_s, **f):
        pass

    def event(self, name, **f):
        self.events.append((name, f))


def _engine(agent, state=None):
    ref = []
    body = Body(ref)
    eng = StepEngine(agent, body, state or State(), Obs())
    ref.append(eng)
    return eng, body


def _run(eng, total):
    async def main():
        try:
            await eng.run(total)
            return None
        except Exception as e:  # noqa: BLE001 - the test inspects what the engine raised
            return e

    return run_virtual(main(), 1)[0]


def test_a_normal_run_commits_every_step_then_drains():
    agent = FakeAgent([_a(0), _a(1), _a(2)])
    eng, body = _engine(agent)
    assert _run(eng, 3) is None
    assert body.ran == [0, 1, 2] and eng.completed and agent.last_committed_step == 2
    assert agent.calls[-2:] == [("goodbye", True), ("drain",)]


def test_a_lost_vote_rolls_back_and_runs_the_same_step_again():
    agent = FakeAgent([_a(0), _a(0, qid=2), _a(1, qid=2)], vote_errors=[CollectiveError("peer died")])
    eng, body = _engine(agent)
    assert _run(eng, 2) is None
    assert body.ran == [0, 0, 1] and eng.counters.steps_retried == 1


@pytest.mark.parametrize("error", [HealError("x"), CoordinatorLost("x")])
def test_retryable_acquire_errors_ask_again(error):
    agent = FakeAgent([error, _a(0)])
    eng, _ = _engine(agent)
    assert _run(eng, 1) is None
    assert [c for c in agent.calls if c[0] == "ask"] == [("ask", 0), ("ask", 0)]
    assert (("reconnect",) in agent.calls) is isinstance(error, CoordinatorLost)


def test_an_unreachable_coordinator_ends_the_job():
    eng, _ = _engine(FakeAgent([CoordinatorLost("gone")], reconnect_fails=True))
    assert isinstance(_run(eng, 1), JobFailed)


def test_no_quorum_within_the_timeout_ends_the_job():
    eng, _ = _engine(FakeAgent([PeerTimeout("no quorum formed within 300.0 s")]))
    err = _run(eng, 1)
    assert isinstance(err, JobFailed) and "no quorum" in str(err)


def test_retries_are_bounded():
    eng, _ = _engine(FakeAgent([HealError("x")] * (MAX_ATTEMPTS_PER_STEP + 5)))
    err = _run(eng, 1)
    assert isinstance(err, JobFailed) and f"after {MAX_ATTEMPTS_PER_STEP} attempts" in str(err)


def test_released_while_behind_is_a_typed_error_naming_both_steps_never_a_normal_end():
    agent = FakeAgent([_a(0), JobOver("the job finished at step 9 while this worker was behind")])
    eng, _ = _engine(agent)
    err = _run(eng, 10)
    assert isinstance(err, FinalStateUnavailable)
    assert (err.held_step, err.final_step) == (0, 9) and not eng.completed
    assert ("goodbye", False) in agent.calls


def test_a_catch_up_ends_the_loop_holding_the_final_state():
    agent = FakeAgent([_a(10, restore_checkpoint="ck/9", catch_up=True)])
    eng, body = _engine(agent, State())
    assert _run(eng, 10) is None and body.ran == [] and eng.completed


def test_an_unusable_checkpoint_is_reported_and_the_step_asked_for_again():
    agent = FakeAgent([_a(5, restore_checkpoint="ck/4"), PeerTimeout("stalled")])
    eng, _ = _engine(agent, State(restore_error=CheckpointError("ck/4: header is not JSON")))
    assert isinstance(_run(eng, 10), JobFailed)
    assert agent.calls == [("ask", 0), ("unusable", "ck/4"), ("ask", 0)]


def test_a_final_checkpoint_that_cannot_be_restored_is_final_state_unavailable():
    agent = FakeAgent([_a(10, restore_checkpoint="ck/9", catch_up=True)])
    eng, _ = _engine(agent, State(restore_error=CheckpointError("gone")))
    assert isinstance(_run(eng, 10), FinalStateUnavailable)


def test_a_checkpoint_writer_writes_after_its_commit():
    agent = FakeAgent([_a(0, write_checkpoint=True)])
    eng, _ = _engine(agent)
    assert _run(eng, 1) is None and ("written", 0) in agent.calls
