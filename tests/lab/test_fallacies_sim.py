"""The network fallacies and the homogeneous one, in the simulator: mechanism off vs on, measured."""

from tests.lab.helpers import run_quick


def test_partition_without_deadlines_commits_nothing_while_deadlines_keep_the_majority_going(tmp_path):
    o = run_quick("fallacy-reliable-network", tmp_path)
    on, off = o.data["deadlines ON"], o.data["deadlines OFF"]
    assert on["commits_during_partition"] > 0 and on["detected_after_s"] is not None
    assert off["commits_during_partition"] == 0 and off["detected_after_s"] is None
    assert off["longest_stall_s"] > 10 * on["longest_stall_s"]


def test_timeout_sized_for_a_local_link_suspects_healthy_workers_on_a_slow_link(tmp_path):
    o = run_quick("fallacy-zero-latency", tmp_path)
    tight, margin = o.data["20 ms link, margin OFF"], o.data["20 ms link, margin ON"]
    assert tight["false_suspicions"] >= 10 * max(1, margin["false_suspicions"])
    assert tight["steps_rolled_back"] > margin["steps_rolled_back"]
    assert o.data["0.2 ms link, margin OFF"]["false_suspicions"] == 0


def test_tree_allreduce_of_large_gradients_is_slower_than_the_ring(tmp_path):
    o = run_quick("fallacy-infinite-bandwidth", tmp_path)
    ring, tree = o.data["ring all-reduce"], o.data["tree all-reduce OFF"]
    assert ring["ok"] and tree["ok"]
    assert tree["median_step_s"] > 2 * ring["median_step_s"]
    assert tree["allreduce_model_s"] > ring["allreduce_model_s"]


def test_syncing_every_step_moves_more_bytes_and_takes_longer(tmp_path):
    o = run_quick("fallacy-zero-transport-cost", tmp_path)
    local, strict = o.data["local-sgd, merge every 10"], o.data["strict, all-reduce every step OFF"]
    assert strict["gigabytes_reduced"] > 3 * local["gigabytes_reduced"] > 0
    assert strict["virtual_s"] > local["virtual_s"]


def test_equal_shares_let_a_slow_worker_set_the_pace(tmp_path):
    o = run_quick("fallacy-homogeneous-network", tmp_path)
    adaptive, equal = o.data["speed-sized shares"], o.data["equal shares OFF"]
    assert adaptive["ok"] and equal["ok"]
    assert equal["median_step_s"] > 1.3 * adaptive["median_step_s"]


def test_a_restarted_coordinator_without_its_fencing_floor_lets_workers_diverge(tmp_path):
    o = run_quick("fencing", tmp_path)
    on, off = o.data["fencing ON"], o.data["fencing OFF"]
    assert on["violations"] == 0 and on["ok"]
    assert off["workers diverged at a step"] > 0 and off["quorum ids reused"] > 0 and not off["ok"]


def test_a_worker_leaving_for_good_stops_a_fixed_world_but_not_the_elastic_quorum_in_the_simulator(tmp_path):
    o = run_quick("fallacy-fixed-topology", tmp_path)
    e, f = o.data["elastic quorum"], o.data["fixed world OFF"]
    assert e["ok"] and e["steps_committed"] == e["steps"]
    assert not f["ok"] and 0 < f["steps_committed"] < f["steps"]
