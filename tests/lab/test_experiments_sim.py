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


def test_latency_lowers_scaling_efficiency(tmp_path):
    o = run_quick("latency", tmp_path)
    cells = o.data["grid"]["cells"]
    big = max(o.data["grid"]["sizes"])
    eff = {(c["latency_ms"], c["workers"]): c["efficiency"] for c in cells}
    assert eff[(0.0, big)] > eff[(1.0, big)] > eff[(5.0, big)] > eff[(20.0, big)]
    assert eff[(20.0, big)] < 0.5
    assert o.data["real_point"] is None  # --sim: no real job


@pytest.mark.slow
def test_one_frozen_worker_in_a_thousand_stalls_the_job_without_detection(tmp_path):
    o = run_quick("one-in-a-thousand", tmp_path)
    runs = o.data["stop_answering"]["runs"]
    assert runs["detection ON"]["ok"] and runs["detection ON"]["detected_after_s"] is not None
    assert runs["detection OFF"]["longest_step_s"] > 2 * runs["detection ON"]["longest_step_s"]
    model = {m["workers"]: m for m in o.data["slowest_of_n_model"]}
    assert model[1]["p99_of_slowest"] < 10 <= model[1000]["p99_of_slowest"]
    assert abs(model[1000]["share_of_steps_slow"] - model[1000]["share_predicted"]) < 0.1
