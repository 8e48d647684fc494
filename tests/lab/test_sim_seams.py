"""The simulator's seams the lab relies on: compute/communication overlap, the quorum's
min_workers, and the lab-only restart_fencing_floor field (refused outside a lab session)."""

import pytest

from phalanx.core.errors import ConfigError
from phalanx.lab.switches import lab_session
from phalanx.sim.cluster import Cluster
from phalanx.sim.scenario import Scenario
from phalanx.sim.workload import SimModelConfig

COMPUTE_S, BUCKETS, WORKERS = 0.05, 4, 4
GRADIENT_BYTES = 40_000_000  # each of the 4 buckets: 2 * 3/4 * 10 MB / 1.25 GB/s = 12 ms on the wire


def _overlap_run(overlap: bool) -> Cluster:
    return Cluster(workers=WORKERS, steps=20, seed=1, model_cfg=SimModelConfig(grad_buckets=BUCKETS, overlap=overlap),
                   gradient_bytes=GRADIENT_BYTES, compute_jitter=0.0)


def test_overlap_starts_each_bucket_during_compute_and_hides_all_but_the_last():
    off, on = _overlap_run(False).run(), _overlap_run(True).run()
    assert off.ok and on.ok
    bucket_s = 2 * (WORKERS - 1) / WORKERS * GRADIENT_BYTES / BUCKETS / 1.25e9
    # off: compute, then every bucket in turn; on: bucket k leaves at compute*(k+1)/B and is done
    # before the next one is ready (12 ms < 12.5 ms), so only the last bucket follows the compute
    assert off.summary["median_step_s"] == pytest.approx(COMPUTE_S + BUCKETS * bucket_s, abs=2e-3)
    assert on.summary["median_step_s"] == pytest.approx(COMPUTE_S + bucket_s, abs=2e-3)
    # the same arithmetic: overlap changes when, not what
    assert on.summary["reference_max_abs_diff"] <= 1e-12 and off.summary["reference_max_abs_diff"] <= 1e-12
    assert on.summary["final_loss"] == off.summary["final_loss"]


def test_overlap_cannot_hide_communication_longer_than_the_compute():
    # 40x the bytes: each bucket takes 0.48 s on the wire, far longer than the 0.05 s of compute;
    # the group's links carry one collective at a time, so the buckets queue behind each other
    runs = {ov: Cluster(workers=WORKERS, steps=8, seed=1, model_cfg=SimModelConfig(grad_buckets=BUCKETS, overlap=ov),
                        gradient_bytes=40 * GRADIENT_BYTES, compute_jitter=0.0, collective_timeout_s=60.0).run()
            for ov in (False, True)}
    saved = runs[False].summary["median_step_s"] - runs[True].summary["median_step_s"]
    assert 0 < saved <= COMPUTE_S * (BUCKETS - 1) / BUCKETS + 1e-3


def test_a_fixed_world_stops_when_a_worker_leaves_and_an_elastic_one_goes_on():
    sc = Scenario(3, 0).crash(2, at_s=1.0, restart=False)
    elastic = Cluster(workers=3, steps=40, plan=sc.plan).run()
    fixed = Cluster(workers=3, steps=40, plan=sc.plan, min_workers=3, max_virtual_s=20.0).run()
    assert elastic.ok and elastic.summary["steps_committed"] == 40
    assert not fixed.ok and 0 < fixed.summary["steps_committed"] < 40


def test_min_workers_outside_one_to_n_is_refused():
    with pytest.raises(ConfigError, match="min_workers"):
        Cluster(workers=3, steps=2, min_workers=4)


def test_switching_the_restart_fencing_floor_off_is_refused_outside_a_lab_session():
    with pytest.raises(ConfigError, match="restart_fencing_floor"):
        Cluster(workers=2, steps=2, restart_fencing_floor=False)
    with lab_session():
        assert not Cluster(workers=2, steps=2, restart_fencing_floor=False).restart_fencing_floor
    with pytest.raises(ConfigError):
        Cluster(workers=2, steps=2, restart_fencing_floor=False)  # the session closed
