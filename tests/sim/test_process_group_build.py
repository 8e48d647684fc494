"""The simulated process group's build cost: a new quorum's group pays CollectiveModel.group_build_s
once, on its first collective (when every rank has arrived, as a real Gloo group finishes
connecting then); later collectives of the same quorum do not; 0 keeps the old costs exactly."""

import asyncio

import numpy as np
import pytest

from phalanx.sim.loop import run_virtual
from phalanx.sim.network import SimNetwork
from phalanx.sim.process_group import CollectiveModel, SimProcessGroupFactory

ALPHA_S = 0.001
WORLD = 3
RING_S = 2 * (WORLD - 1) * ALPHA_S  # one all-reduce of a 3-rank ring, no bandwidth term


def _collective_times_s(model: CollectiveModel, quorum_ids: list[int], per_quorum: int) -> list[float]:
    """How long each collective takes, from the last rank's arrival to completion, for
    ``per_quorum`` collectives in each quorum id in turn (ranks enter each at the same instant)."""

    async def main() -> list[float]:
        net = SimNetwork(0)
        factory = SimProcessGroupFactory(net, model)
        nodes = [net.add_node(f"w{r}") for r in range(WORLD)]
        took = []
        for qid in quorum_ids:
            groups = [await factory.for_node(n).create(qid, r, WORLD, 5.0) for r, n in enumerate(nodes)]
            for k in range(per_quorum):
                tensors = [np.full(4, float(r + k)) for r in range(WORLD)]
                t0 = asyncio.get_running_loop().time()
                pending = [g.start_allreduce_sum(t) for g, t in zip(groups, tensors)]
                await asyncio.gather(*(p.wait(5.0) for p in pending))
                took.append(asyncio.get_running_loop().time() - t0)
                assert all(np.array_equal(t, np.full(4, float(3 * k + 3))) for t in tensors), "summed for real"
        return took

    took, _ = run_virtual(main(), seed=0)
    return took


def test_a_new_quorums_first_collective_pays_the_group_build():
    took = _collective_times_s(CollectiveModel(alpha_s=ALPHA_S, beta_s_per_byte=0.0, group_build_s=0.25), [7], 1)
    assert took[0] == pytest.approx(0.25 + RING_S)


def test_the_build_is_charged_once_per_quorum_id_not_per_collective():
    took = _collective_times_s(CollectiveModel(alpha_s=ALPHA_S, beta_s_per_byte=0.0, group_build_s=0.25), [7, 8], 3)
    # quorum 7: built, then two plain collectives; quorum 8 (a new group): built again, then plain
    assert took == pytest.approx([0.25 + RING_S, RING_S, RING_S] * 2)


def test_no_build_cost_by_default_leaves_every_collective_at_its_alpha_beta_cost():
    took = _collective_times_s(CollectiveModel(alpha_s=ALPHA_S, beta_s_per_byte=0.0), [7, 8], 2)
    assert took == pytest.approx([RING_S] * 4)


def _cluster_run(group_build_s: float):
    from phalanx.faults.plan import parse_fault_plan
    from phalanx.sim.cluster import Cluster

    plan = parse_fault_plan('[[fault]]\nkind = "kill"\nworker = 1\nat_step = 5\nrestart = true\n', "<test>")
    return Cluster(workers=3, steps=30, seed=3, plan=plan, restart_delay_s=0.3,
                   collective=CollectiveModel(group_build_s=group_build_s)).run()


def test_a_cluster_pays_the_build_at_each_new_quorums_first_step_and_repeats_byte_for_byte():
    plain, built, again = _cluster_run(0.0), _cluster_run(0.2), _cluster_run(0.2)
    assert plain.ok and built.ok
    assert built.commits == again.commits and built.events == again.events  # same seed, same run
    quorums = {c["quorum_id"] for c in built.commits}
    assert len(quorums) >= 3  # the first, the one without the killed worker, the one it rejoined
    # every quorum's first commit waited for its group's build; the same steps without it did not
    firsts = [c for prev, c in zip(built.commits, built.commits[1:]) if c["quorum_id"] != prev["quorum_id"]]
    assert firsts and all(c["step_s"] >= 0.2 for c in firsts)
    # before the kill: step 0 (quorum 1's first) pays the build once; steps 1-4 cost what they did without
    # it (within the compute jitter, whose draws shift with the timeline)
    assert built.commits[0]["step_s"] == pytest.approx(plain.commits[0]["step_s"] + 0.2, abs=0.005)
    assert [c["step_s"] for c in built.commits[1:5]] == pytest.approx([c["step_s"] for c in plain.commits[1:5]], abs=0.005)
