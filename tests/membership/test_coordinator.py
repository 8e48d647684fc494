"""The coordinator driver on the simulated host: hand-driven workers send exactly the frames a
test needs. Buggy or hostile (but authenticated) workers are refused and the coordinator keeps
deciding for everyone else."""

import asyncio

from phalanx.core.messages import (
    AllreduceDone, Bundle, CheckpointWritten, Goodbye, Heartbeat, Hello, QuorumAssigned, QuorumRequest, Refused, Welcome,
)
from phalanx.membership.coordinator import Coordinator, CoordinatorConfig
from phalanx.membership.outbox import OUTBOX_MAX
from phalanx.membership.quorum import QuorumConfig
from phalanx.sim.host import SimHost
from phalanx.sim.loop import run_virtual
from phalanx.sim.connection import SimTransport
from phalanx.sim.network import SimNetwork


def _run(scenario, _seed=1, **cfg):
    async def main():
        loop = asyncio.get_running_loop()
        net = SimNetwork(_seed)
        net.install_task_factory(loop)
        cnode = net.add_node("coordinator")
        ccfg = CoordinatorConfig(**{"quorum": QuorumConfig(expected_workers=1, join_timeout_s=0.5), **cfg})
        coord = Coordinator(SimHost(net, cnode, 1), ccfg, "store")
        addr = await net.spawn(cnode, coord.start("coordinator"), "start")

        async def connect(wid, step=-1, qid=0, has_state=False):
            node = net.add_node(wid) if wid not in net.nodes else net.nodes[wid]
            conn = await net.spawn(node, SimTransport(net, node).connect(addr, 1.0), "connect")
            await conn.send(Hello(worker_id=wid, incarnation=f"{wid}-{loop.time()}", pid=1, heal_address="",
                                  last_committed_step=step, max_quorum_id_seen=qid, has_state=has_state))
            reply, _ = await conn.recv()
            return conn, reply

        return await scenario(coord, connect, loop)

    return run_virtual(main(), _seed)[0]


async def _next(conn, kind, timeout_s=5.0):
    async def wait():
        while True:
            m, _ = await conn.recv()
            if isinstance(m, kind):
                return m

    return await asyncio.wait_for(wait(), timeout_s)


def test_the_request_that_completes_the_askers_forms_the_quorum_at_once_even_after_a_blocked_tick():
    async def scenario(coord, connect, loop):
        a, _ = await connect("w0")
        b, _ = await connect("w1")
        await a.send(QuorumRequest(step=0, last_committed_step=-1, has_state=False))
        await asyncio.sleep(0.12)  # ticks ran while only w0 asked: formation waited for w1 (blocked)
        t0 = loop.time()
        await b.send(QuorumRequest(step=0, last_committed_step=-1, has_state=False))
        got = await _next(b, QuorumAssigned)
        return loop.time() - t0, got

    delay_s, got = _run(scenario, tick_s=0.05)
    assert got.members == ["w0", "w1"]
    assert delay_s < 0.01, f"waited {delay_s:.3f} s for the next tick instead of forming at once"


def test_hello_claiming_a_step_nobody_committed_is_refused_and_the_others_go_on():
    async def scenario(coord, connect, loop):
        a, _ = await connect("w0")
        await a.send(QuorumRequest(step=0, last_committed_step=-1, has_state=False))
        await _next(a, QuorumAssigned)  # a quorum for step 0 is in flight
        _, reply = await connect("w9", step=10**9, qid=10**12, has_state=True)
        await a.send(Heartbeat(seq=1, step=-1))
        await asyncio.sleep(0.2)  # ticks keep running (the ticker did not die on an assert)
        return reply, coord.cluster_step, coord.max_id_seen, coord.quorum.step

    reply, cluster_step, max_id, qstep = _run(scenario)
    assert isinstance(reply, Refused) and "step 1000000000" in reply.reason
    assert (cluster_step, max_id, qstep) == (-1, 1, 0)


def test_checkpoint_written_for_a_step_never_committed_is_refused_and_logged():
    async def scenario(coord, connect, loop):
        a, _ = await connect("w0")
        await a.send(CheckpointWritten(step=10**9, path="/etc/passwd"))
        await a.send(QuorumRequest(step=0, last_committed_step=-1, has_state=False))
        got = await _next(a, QuorumAssigned)
        return coord.checkpoint, [e for e in coord.events if e["event"] == "message_refused"], got

    checkpoint, refused, got = _run(scenario)
    assert checkpoint == ("", -1) and got.step == 0
    assert refused and refused[0]["kind"] == "CheckpointWritten"


def test_a_message_no_worker_sends_is_refused_without_harm():
    async def scenario(coord, connect, loop):
        a, _ = await connect("w0")
        await a.send(Welcome(run_id="x", store_address="y", heartbeat_interval_s=0.1, collective_timeout_s=1.0,
                             checkpoint_every_steps=0, run_dir=""))
        await a.send(QuorumRequest(step=0, last_committed_step=-1, has_state=False))
        return await _next(a, QuorumAssigned), coord.refused

    got, refused = _run(scenario)
    assert got.step == 0 and refused == {"Welcome": 1}


def test_distinct_worker_ids_beyond_sessions_max_are_refused():
    async def scenario(coord, connect, loop):
        replies = [(await connect(f"w{i}"))[1] for i in range(3)]
        return replies

    replies = _run(scenario, sessions_max=2)
    assert [type(r) for r in replies] == [Welcome, Welcome, Refused]
    assert "sessions_max" in replies[2].reason


def test_drainers_are_released_as_soon_as_every_worker_said_goodbye():
    async def scenario(coord, connect, loop):
        a, _ = await connect("w0", has_state=True)
        b, _ = await connect("w1", has_state=True)
        await a.send(Goodbye(completed=True, reason="finished", final_step=-1))
        await asyncio.sleep(0.1)
        early = [s.released for s in coord.sessions.values()]
        await b.send(Goodbye(completed=True, reason="finished", final_step=-1))
        await asyncio.sleep(0.1)
        return early, [s.released for s in coord.sessions.values()]

    early, late = _run(scenario)
    assert early == [False, False] and late == [True, True]


def test_a_worker_whose_outbox_fills_loses_its_connection_instead_of_silently_missing_messages():
    async def scenario(coord, connect, loop):
        a, _ = await connect("w0")
        s = coord.sessions["w0"]
        while len(s.outbox) < OUTBOX_MAX:  # as if its socket had stopped draining
            s.outbox.append(Heartbeat(seq=0, step=-1))
        s.sending = True  # a send that had to wait is under way: nothing is flushed meanwhile
        coord._send(s, Refused(reason="one message too many"))
        await asyncio.sleep(0.1)
        return [e for e in coord.events if e["event"] in ("connection_lost", "worker_suspected")]

    events = _run(scenario)
    lost = next(e for e in events if e["event"] == "connection_lost")
    assert lost["worker"] == "w0" and "1024 messages queued for w0 unsent" in lost["reason"]
    assert any(e["event"] == "worker_suspected" and e["worker"] == "w0" for e in events)


def test_an_epochs_member_list_goes_once_and_the_next_grant_rides_with_the_decision():
    async def scenario(coord, connect, loop):
        conns = [(await connect(w))[0] for w in ("w0", "w1")]
        for c in conns:
            await c.send(QuorumRequest(step=0, last_committed_step=-1, has_state=False))
        first = [await _next(c, QuorumAssigned) for c in conns]
        for c, a in zip(conns, first):
            await c.send(AllreduceDone(step=0, quorum_id=a.quorum_id, ok=True, samples_covered_once=True, next_step=1))
        return first, [await _next(c, Bundle) for c in conns]

    first, bundles = _run(scenario, quorum=QuorumConfig(expected_workers=2, join_timeout_s=0.5))
    assert [a.members for a in first] == [["w0", "w1"]] * 2
    for rank, b in enumerate(bundles):
        decision, grant = b.items
        assert decision.commit and decision.step == 0
        assert (grant.step, grant.quorum_id, grant.rank, grant.members) == (1, first[0].quorum_id, rank, [])
