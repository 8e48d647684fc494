"""Which worker is told what for each network fault of a plan (a pure function, table-tested)."""

import pytest

from phalanx.core.errors import FaultPlanError
from phalanx.faults.plan import parse_fault_plan
from phalanx.runtime.fault_injector import network_fault_messages


def resolve(body: str, workers: int = 4):
    plan = parse_fault_plan("[[fault]]\n" + body + "at_step = 1\n", "p.toml")
    plan.validate_workers(workers)  # target indices against the run's size
    return network_fault_messages(plan.faults[0], workers)


@pytest.mark.parametrize("body, groups, targets", [
    ('kind = "partition"\nfor_s = 1\nisolate = 2\n', [[], ["w2"]], ("w2",)),
    ('kind = "partition"\nfor_s = 1\ngroups = [[0, 1], [2, 3]]\n', [["w0", "w1"], ["w2", "w3"]], ("w2", "w3")),
    ('kind = "partition"\nfor_s = 1\n', [[], ["w3"]], ("w3",)),  # default: the workers above the middle
])
def test_every_worker_learns_the_sides_of_a_partition(body, groups, targets):
    messages, got_targets = resolve(body)
    assert sorted(messages) == ["w0", "w1", "w2", "w3"]
    assert all(m.kind == "partition" and m.groups == groups and m.for_s == 1.0 for m in messages.values())
    assert got_targets == targets


def test_an_untargeted_link_fault_degrades_every_link_of_every_worker():
    messages, targets = resolve('kind = "latency"\nmean_ms = 20\njitter_ms = 5\n')
    assert targets == ("w0", "w1", "w2", "w3")
    assert all(m.mean_ms == 20 and m.jitter_ms == 5 and m.peers == [] for m in messages.values())


def test_a_targeted_link_fault_also_tells_the_peers_of_the_targets():
    messages, targets = resolve('kind = "loss"\nprobability = 0.1\nworkers = [1]\n')
    assert targets == ("w1",)
    assert messages["w1"].peers == [] and messages["w0"].peers == ["w1"] and messages["w3"].peers == ["w1"]


def test_a_pair_fault_reaches_only_the_two_ends_of_that_link():
    messages, targets = resolve('kind = "bandwidth"\nbytes_per_s = 1e6\npair = [0, 3]\n')
    assert targets == ("w0", "w3") and sorted(messages) == ["w0", "w3"]
    assert messages["w0"].peers == ["w3"] and messages["w3"].peers == ["w0"]


@pytest.mark.parametrize("body, problem", [
    ('kind = "partition"\nfor_s = 1\nisolate = 9\n', "worker 9"),
    ('kind = "partition"\nfor_s = 1\ngroups = [[0, 1], [1, 2]]\n', "in two groups"),
    ('kind = "partition"\nfor_s = 1\ngroups = [0, 1]\n', "list of at least two non-empty lists"),
    ('kind = "latency"\nmean_ms = 5\ndistribution = "uniform"\n', "'distribution'"),
    ('kind = "loss"\nprobability = 0.1\npair = [1, 1]\n', "two different worker"),
])
def test_bad_targets_are_rejected_with_the_plan_line(body, problem):
    # at parse time (the shape, on the key's own line) or before the run (an index, on the fault's)
    with pytest.raises(FaultPlanError, match=problem) as ei:
        resolve(body)
    key_line = 1 + next(i for i, line in enumerate(body.splitlines(), 1) if line.split(" =")[0] in
                        ("isolate", "groups", "distribution", "pair"))
    assert ei.value.path == "p.toml" and ei.value.line in (1, key_line)
