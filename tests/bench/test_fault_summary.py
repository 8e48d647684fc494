"""The training benchmark reports every run of each fault, with the median and range, not one sample."""

from phalanx.bench.training import fault_summary


def test_the_summary_keeps_every_run_and_gives_median_and_range():
    runs = [{"detected_after_s": 0.02, "recovered_after_s": 0.07},
            {"detected_after_s": 0.03, "recovered_after_s": 0.13},
            {"detected_after_s": 0.01, "recovered_after_s": 0.06}]
    s = fault_summary(runs)
    assert s["runs"] == runs
    assert s["recovered_after_s"] == {"median": 0.07, "min": 0.06, "max": 0.13}
    assert s["detected_after_s"] == {"median": 0.02, "min": 0.01, "max": 0.03}


def test_a_run_that_never_recovered_is_the_slowest_not_left_out():
    s = fault_summary([{"detected_after_s": 0.6, "recovered_after_s": None},
                       {"detected_after_s": 0.6, "recovered_after_s": 0.65}])
    assert s["recovered_after_s"]["max"] == float("inf") and s["recovered_after_s"]["min"] == 0.65
