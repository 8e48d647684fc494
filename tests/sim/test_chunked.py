import pytest

from phalanx.sim.chunked import ring_allreduce_time, ring_formula_s
from phalanx.sim.process_group import CollectiveModel


@pytest.mark.parametrize("ranks", [2, 3, 8, 33])
def test_per_chunk_ring_matches_the_closed_form_on_uniform_links(ranks):
    r = ring_allreduce_time(ranks, 4_000_000, 20e-6, 1 / 1.25e9)
    assert r.messages == 2 * (ranks - 1) * ranks
    assert r.finish_s == pytest.approx(ring_formula_s(ranks, 4_000_000, 20e-6, 1 / 1.25e9), rel=1e-9)
    # the closed form the default SimProcessGroup charges is the same model (alpha per step)
    m = CollectiveModel(alpha_s=20e-6, beta_s_per_byte=1 / 1.25e9)
    assert m.allreduce_s(ranks, 4_000_000) == pytest.approx(r.finish_s, rel=1e-9)


def test_one_slow_link_slows_the_whole_ring():
    fast = ring_allreduce_time(8, 8_000_000, 20e-6, 1 / 1.25e9)
    betas = [1 / 1.25e9] * 8
    betas[3] = 10 / 1.25e9
    slow = ring_allreduce_time(8, 8_000_000, 20e-6, betas)
    assert slow.finish_s > 5 * fast.finish_s
