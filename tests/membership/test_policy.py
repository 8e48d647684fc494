"""The coordinator's policies (membership/policy.py), as tables of named cases."""

import pytest

from phalanx.core.modes import ConsistencyMode as M
from phalanx.membership import policy
from phalanx.membership.policy import CheckpointPolicy


@pytest.mark.parametrize("name, old, share, compute_s, expected", [
    ("first measurement is the speed", None, 0.5, 0.25, 2.0),
    ("a new measurement weighs half", 2.0, 0.5, 0.125, 3.0),
    ("nothing measured keeps the old value", 2.0, 0.0, 0.1, 2.0),
    ("no compute time keeps the old value", 2.0, 0.5, 0.0, 2.0),
    ("never measured and nothing to measure", None, 0.0, 0.1, None),
])
def test_updated_speed(name, old, share, compute_s, expected):
    assert policy.updated_speed(old, share, compute_s) == expected, name


@pytest.mark.parametrize("name, mode, members, speeds, expected", [
    ("strict shares evenly", M.STRICT, ("w0", "w1"), {"w0": 1.0, "w1": 3.0}, []),
    ("available: proportional to speed", M.AVAILABLE, ("w0", "w1"), {"w0": 1.0, "w1": 3.0}, [0.25, 0.75]),
    ("available: unmeasured get the mean", M.AVAILABLE, ("w0", "w1", "w2"), {"w0": 1.0, "w1": 9.0},
     [1 / 11, 5 / 11, 5 / 11]),  # the mean, 5, is the median: 9 is within 2x of it, 1 is not
    ("available: within 2x of the median is even (scheduling noise)", M.AVAILABLE, ("w0", "w1", "w2", "w3"),
     {"w0": 1.0, "w1": 1.9, "w2": 0.6, "w3": 1.2}, [0.25, 0.25, 0.25, 0.25]),
    ("available: a 3x straggler gets its smaller share, the rest even", M.AVAILABLE, ("w0", "w1", "w2", "w3"),
     {"w0": 1.0, "w1": 1.3, "w2": 0.35, "w3": 0.9}, [0.9 / 3.05, 0.9 / 3.05, 0.35 / 3.05, 0.9 / 3.05]),
    ("available: nothing measured is even", M.AVAILABLE, ("w0", "w1"), {}, [0.5, 0.5]),
])
def test_shard_weights(name, mode, members, speeds, expected):
    assert policy.shard_weights(mode, members, speeds) == pytest.approx(expected), name


@pytest.mark.parametrize("name, mode, total, cluster_step, completed, expected", [
    ("strict: last step committed", M.STRICT, 10, 9, 0, True),
    ("strict: one step to go", M.STRICT, 10, 8, 0, False),
    ("strict: length unknown", M.STRICT, -1, 100, 3, False),
    ("available like strict", M.AVAILABLE, 10, 9, 0, True),
    ("local-sgd: a worker finished", M.LOCAL_SGD, 10, 2, 1, True),
    ("local-sgd: nobody finished", M.LOCAL_SGD, 10, 9, 0, False),
])
def test_job_finished(name, mode, total, cluster_step, completed, expected):
    assert policy.job_finished(mode, total, cluster_step, completed) is expected, name


@pytest.mark.parametrize("name, pol, mode, total, step, local_step, healing, expected", [
    ("off, not the last step", CheckpointPolicy(0, True), M.STRICT, 10, 4, -1, {}, ""),
    ("every 5: step 4 is the 5th", CheckpointPolicy(5, False), M.STRICT, 10, 4, -1, {}, "w0"),
    ("every 5: step 5 is not", CheckpointPolicy(5, False), M.STRICT, 10, 5, -1, {}, ""),
    ("the last step, durable storage", CheckpointPolicy(0, True), M.STRICT, 10, 9, -1, {}, "w0"),
    ("the last step, no storage", CheckpointPolicy(0, False), M.STRICT, 10, 9, -1, {}, ""),
    ("a healing member does not write", CheckpointPolicy(5, False), M.STRICT, 10, 4, -1, {"w0": "w1"}, "w1"),
    ("local-sgd: the final merge", CheckpointPolicy(0, True), M.LOCAL_SGD, 30, 6, 30, {}, "w0"),
    ("local-sgd: a middle merge", CheckpointPolicy(0, True), M.LOCAL_SGD, 30, 3, 15, {}, ""),
])
def test_checkpoint_writer(name, pol, mode, total, step, local_step, healing, expected):
    assert policy.checkpoint_writer(pol, mode, total, step, local_step, ("w0", "w1"), healing) == expected, name


@pytest.mark.parametrize("name, now_s, members, present, expected", [
    ("all present", 1.0, {"w0", "w1"}, {"w0", "w1", "w2"}, ((), False)),
    ("one missing, still waiting", 1.0, {"w0", "w1"}, {"w0"}, (("w1",), False)),
    ("one missing, waited too long", 11.0, {"w0", "w1"}, {"w0"}, (("w1",), True)),
])
def test_awaiting_holders(name, now_s, members, present, expected):
    assert policy.awaiting_holders(now_s, 10.0, members, present) == expected, name


@pytest.mark.parametrize("name, step, qid, authoritative, ok", [
    ("a worker behind", 3, 2, True, True),
    ("a worker at the cluster step", 5, 4, True, True),
    ("a step nobody committed", 6, 4, True, False),
    ("an id never issued", 5, 9, True, False),
    ("a fresh incarnation learns from Hellos", 50, 40, False, True),
    ("beyond the codec's bound", 2**63, 1, False, False),
])
def test_hello_refusal(name, step, qid, authoritative, ok):
    why = policy.hello_refusal(step, qid, authoritative, cluster_step=5, max_id_seen=4, id_limit=2**62)
    assert (why == "") is ok, (name, why)
