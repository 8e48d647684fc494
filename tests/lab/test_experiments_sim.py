"""partial-failure, cap, latency (simulator forms) and one-in-a-thousand: claims from measured numbers."""

import pytest

from tests.lab.helpers import run_quick


def test_partial_failures_are_told_apart_and_the_hang_needs_the_progress_detector(tmp_path):
    o = run_quick("partial-failure", tmp_path)
    by = {r["case"]: r for r in o.data["faults"]}
    assert o.data["job_ok"]
    assert by["crash"]["detected_after_s"] < by["freeze"]["detected_after_s"]  # the connection drops at once
    assert by["slow"]["detected_after_s"] is None  # slow is not failed
    hung = by["hung, heartbeating"]["detected_after_s"]
    assert hung is not None and hung >= 1.5  # only the progress watch (2 s) sees it
    assert o.data["hung_without_progress_watch"]["hung"]
    assert o.data["hung_without_progress_watch"]["commits_after_hang"] == 0
    assert not o.data["hung_without_progress_detector"]["hung"]  # the all-reduce deadline still catches it
    assert o.claim_held
    assert (tmp_path / "partial-failure" / "plots" / "step_times.png").stat().st_size > 1000


def test_cap_strict_equals_the_reference_and_available_keeps_exactly_once(tmp_path):
    o = run_quick("cap", tmp_path)
    by = {r["run"]: r for r in o.data["rows"]}
    assert by["strict"]["ok"] and by["strict"]["reference_max_abs_diff"] <= 1e-5
    assert by["strict"]["samples_exactly_once"] and by["available"]["samples_exactly_once"]
    assert by["local-sgd"]["ok"]
    assert by["available"]["throughput_vs_fault_free"] > by["strict"]["throughput_vs_fault_free"]


def test_latency_lowers_scaling_efficiency_and_overlap_hides_only_what_the_compute_covers(tmp_path):
    o = run_quick("latency", tmp_path)
    g = o.data["grid"]
    big = max(g["sizes"])
    eff = {(c["latency_ms"], c["workers"], m): c[m]["efficiency"] for c in g["cells"] for m in ("overlap", "no overlap")}
    step = {(c["latency_ms"], c["workers"], m): c[m]["median_step_s"] for c in g["cells"]
            for m in ("overlap", "no overlap")}
    for m in ("overlap", "no overlap"):  # measured both ways
        assert eff[(0.0, big, m)] > eff[(1.0, big, m)] > eff[(5.0, big, m)] > eff[(20.0, big, m)]
        assert eff[(20.0, big, m)] < 0.5
    # overlap: never slower; at 0 ms the buckets hide behind the compute; at 20 ms it saves at most the compute
    assert all(step[(lat, n, "overlap")] <= step[(lat, n, "no overlap")] + 1e-3 for lat, n, _ in step)
    assert eff[(0.0, big, "overlap")] >= eff[(0.0, big, "no overlap")] + 0.05
    saved_20 = step[(20.0, big, "no overlap")] - step[(20.0, big, "overlap")]
    assert 0 < saved_20 <= 0.05 + 1e-3 and saved_20 / step[(20.0, big, "no overlap")] < 0.05
    assert o.data["real_point"] is None  # --sim: no real job
    assert o.claim_held


@pytest.mark.slow
def test_one_frozen_worker_in_a_thousand_stalls_the_job_without_detection(tmp_path):
    o = run_quick("one-in-a-thousand", tmp_path)
    runs = o.data["stop_answering"]["runs"]
    assert runs["detection ON"]["ok"] and runs["detection ON"]["detected_after_s"] is not None
    assert runs["detection OFF"]["longest_step_s"] > 2 * runs["detection ON"]["longest_step_s"]
    model = {m["workers"]: m for m in o.data["slowest_of_n_model"]}
    assert model[1]["p99_of_slowest"] < 10 <= model[1000]["p99_of_slowest"]
    assert abs(model[1000]["share_of_steps_slow"] - model[1000]["share_predicted"]) < 0.1


def test_real_point_counts_only_intervals_wholly_inside_or_wholly_outside_a_latency_window():
    from phalanx.lab.latency import split_intervals

    commits = [0.0, 0.4, 0.9, 1.3, 1.6, 2.2, 2.5]
    inside, outside = split_intervals(commits, [(0.8, 1.7)])
    assert inside == pytest.approx([0.4, 0.3])  # 0.9-1.3, 1.3-1.6
    assert outside == pytest.approx([0.4, 0.3])  # 0.0-0.4, 2.2-2.5 (0.4-0.9 and 1.6-2.2 straddle an edge)
