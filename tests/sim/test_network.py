"""The simulated network's TCP model: duplicated and reordered segments cost bytes and time, never
order or exactly-once delivery; impairments touch only the links they name."""

import asyncio

import pytest

from phalanx.sim.loop import run_virtual
from phalanx.sim.connection import SimTransport
from phalanx.sim.network import Impairment, LinkModel, SimNetwork


def _stream(link: LinkModel, messages: int = 400, seed: int = 1, gap_s: float = 0.0005):
    """a sends numbered frames to b; returns (payloads as received, per-frame delays, network)."""

    async def main():
        net = SimNetwork(seed, link)
        net.install_task_factory(asyncio.get_running_loop())
        a, b = net.add_node("a"), net.add_node("b")
        got: list[int] = []
        delays: list[float] = []
        done = asyncio.get_running_loop().create_future()

        async def serve(conn):
            while len(got) < messages:
                msg, _ = await conn.recv()
                got.append(msg["i"])
                delays.append(asyncio.get_running_loop().time() - msg["sent_s"])
            done.set_result(None)

        addr = await SimTransport(net, b).listen("b", serve)
        conn = await net.spawn(a, SimTransport(net, a).connect(addr.address, 1.0), "connect")
        for i in range(messages):
            await conn.send({"i": i, "sent_s": asyncio.get_running_loop().time()}, [b"x" * 1000])
            await asyncio.sleep(gap_s)
        await done
        return got, delays, net

    return run_virtual(main(), seed)[0]


def test_duplicated_and_reordered_frames_arrive_exactly_once_in_order():
    got, _, net = _stream(LinkModel(duplicate_probability=0.3, reorder_probability=0.3, reorder_delay_s=0.004))
    assert got == list(range(400))
    assert net.frames_duplicated > 50 and net.frames_reordered > 50  # the faults really fired


def test_duplication_costs_bytes_on_the_wire_but_no_frames():
    _, _, clean = _stream(LinkModel())
    _, _, dup = _stream(LinkModel(duplicate_probability=0.5))
    assert dup.messages_sent == clean.messages_sent
    assert dup.bytes_sent == clean.bytes_sent + dup.bytes_duplicated
    assert 0.35 < dup.bytes_duplicated / clean.bytes_sent < 0.65


def test_duplication_slows_a_saturated_link():
    slow = dict(bandwidth_bytes_per_s=2e6)  # 1 kB frames every 0.5 ms: half the link's capacity
    _, clean, _ = _stream(LinkModel(**slow))
    _, dup, _ = _stream(LinkModel(**slow, duplicate_probability=0.9))  # ~1.9x the bytes: over capacity
    assert sum(dup) / len(dup) > 10 * sum(clean) / len(clean)


def test_reordering_delays_the_frame_and_the_frames_queued_behind_it():
    _, clean, _ = _stream(LinkModel(jitter_s=0.0))
    _, late, net = _stream(LinkModel(jitter_s=0.0, reorder_probability=0.05, reorder_delay_s=0.01))
    base = max(clean)
    held = [d for d in late if d > base + 1e-9]
    # head-of-line blocking: more frames wait than were themselves reordered
    assert len(held) > net.frames_reordered > 5
    assert max(late) == pytest.approx(base + 0.01, abs=1e-6)


def test_an_impairment_covers_only_the_links_it_names():
    net = SimNetwork(0)
    a, b, c = (net.add_node(n) for n in ("w0", "w1", "w2"))
    pair = Impairment((("loss", 0.5),), pair=frozenset({"w0", "w1"}))
    nodes = Impairment((("latency_s", 0.01),), nodes=frozenset({"w2"}))
    net.impair(pair)
    net.impair(nodes)
    assert net.link_between(a, b).loss == 0.5 and net.link_between(b, a).loss == 0.5
    assert net.link_between(a, c).loss == 0.0 and net.link_between(a, c).latency_s == 0.01
    assert net.link_between(a, b).latency_s == net.link.latency_s
    net.restore(pair)
    assert net.link_between(a, b).loss == 0.0 and net.link_between(c, b).latency_s == 0.01
    net.restore(nodes)
    assert net.link_between(c, b) is net.link


def test_overlapping_link_faults_restore_the_original_link():
    # a shorter fault inside a longer one, and one that ends after: each removes only itself
    from phalanx.sim.scenario import Scenario

    r = (Scenario(workers=3, seed=2)
         .latency(mean_ms=20, at_s=0.1, for_s=1.0)
         .latency(mean_ms=50, at_s=0.5, for_s=2.0)
         .run_until(step=60))
    assert r.ok, (r.reason, r.violations)
    late = [c["step_s"] for c in r.commits if c["committed_at_s"] > 3.0]
    slow = [c["step_s"] for c in r.commits if 0.7 < c["committed_at_s"] < 2.4]
    assert late and slow and max(late) < min(slow)  # back to the base link once both ended
