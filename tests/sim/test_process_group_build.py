"""The simulated process group's build: every rank's ``create`` waits for the last rank of its
quorum to come (the store rendezvous of a real group), then CollectiveModel.group_build_s (every
pair connecting); collectives then cost only their alpha-beta; 0 keeps the old costs exactly. A
rank that never comes holds the others until their deadline."""

import asyncio

import numpy as np
import pytest

from phalanx.core.errors import CollectiveError
from phalanx.sim.loop import run_virtual
from phalanx.sim.network import SimNetwork
from phalanx.sim.process_group import CollectiveModel, SimProcessGroupFactory

ALPHA_S = 0.001
WORLD = 3
RING_S = 2 * (WORLD - 1) * ALPHA_S  # one all-reduce of a 3-rank ring, no bandwidth term
LATE_S = 0.1  # the last rank comes to build each group this long after the others


def _times_s(model: CollectiveModel, quorum_ids: list[int], per_quorum: int) -> tuple[list[float], list[float]]:
    """For each quorum id in turn: how long its group took to form after its last rank came,
    then how long each of ``per_quorum`` collectives took (ranks enter each at the same instant)."""

    async def main() -> tuple[list[float], list[float]]:
        loop = asyncio.get_running_loop()
        net = SimNetwork(0)
        factory = SimProcessGroupFactory(net, model)
        nodes = [net.add_node(f"w{r}") for r in range(WORLD)]
        builds, took = [], []
        for qid in quorum_ids:
            async def build(r: int, n):
                if r == WORLD - 1:
                    await asyncio.sleep(LATE_S)
                return await factory.for_node(n).create(qid, r, WORLD, 5.0)

            t0 = loop.time()
            groups = await asyncio.gather(*(build(r, n) for r, n in enumerate(nodes)))
            builds.append(loop.time() - t0 - LATE_S)
            for k in range(per_quorum):
                tensors = [np.full(4, float(r + k)) for r in range(WORLD)]
                t0 = loop.time()
                pending = [g.start_allreduce_sum(t) for g, t in zip(groups, tensors)]
                await asyncio.gather(*(p.wait(5.0) for p in pending))
                took.append(loop.time() - t0)
                assert all(np.array_equal(t, np.full(4, float(3 * k + 3))) for t in tensors), "summed for real"
        return builds, took

    result, _ = run_virtual(main(), seed=0)
    return result


def test_a_new_quorums_group_forms_after_its_last_rank_came_plus_the_build():
    builds, took = _times_s(CollectiveModel(alpha_s=ALPHA_S, beta_s_per_byte=0.0, group_build_s=0.25), [7], 1)
    assert builds == pytest.approx([0.25 + 2 * ALPHA_S]) and took == pytest.approx([RING_S])


def test_the_build_is_paid_once_per_quorum_id_not_per_collective():
    builds, took = _times_s(CollectiveModel(alpha_s=ALPHA_S, beta_s_per_byte=0.0, group_build_s=0.25), [7, 8], 3)
    assert builds == pytest.approx([0.25 + 2 * ALPHA_S] * 2) and took == pytest.approx([RING_S] * 6)


def test_no_build_cost_by_default_leaves_the_rendezvous_and_alpha_beta_costs():
    builds, took = _times_s(CollectiveModel(alpha_s=ALPHA_S, beta_s_per_byte=0.0), [7, 8], 2)
    assert builds == pytest.approx([2 * ALPHA_S] * 2) and took == pytest.approx([RING_S] * 4)


def test_a_rank_that_never_comes_holds_the_others_until_their_deadline():
    async def main() -> float:
        net = SimNetwork(0)
        factory = SimProcessGroupFactory(net, CollectiveModel())
        nodes = [net.add_node(f"w{r}") for r in range(WORLD)]
        t0 = asyncio.get_running_loop().time()
        results = await asyncio.gather(*(factory.for_node(n).create(9, r, WORLD, 2.0) for r, n in enumerate(nodes[:2])),
                                       return_exceptions=True)
        assert all(isinstance(e, CollectiveError) and "2 of 3 ranks came" in str(e) for e in results)
        return asyncio.get_running_loop().time() - t0

    waited, _ = run_virtual(main(), seed=0)
    assert waited == pytest.approx(2.0)


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
    # every quorum's first commit waited for its group's build (0.2 s, longer than the step's 0.05 s
    # of compute, which runs while the group forms); the same steps without it did not
    firsts = [c for prev, c in zip(built.commits, built.commits[1:]) if c["quorum_id"] != prev["quorum_id"]]
    assert firsts and all(c["step_s"] >= 0.2 for c in firsts)
    # before the kill: step 0 (quorum 1's first) pays the build, less the compute it overlapped;
    # steps 1-4 cost what they did without it (within the compute jitter, whose draws shift with the timeline)
    assert plain.commits[0]["step_s"] + 0.1 < built.commits[0]["step_s"] < plain.commits[0]["step_s"] + 0.2
    assert [c["step_s"] for c in built.commits[1:5]] == pytest.approx([c["step_s"] for c in plain.commits[1:5]], abs=0.005)
