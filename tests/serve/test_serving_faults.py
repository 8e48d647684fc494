"""Serving fault plans reuse the training vocabulary and refuse what a replica cannot suffer, with file:line."""

from __future__ import annotations

import pytest

from phalanx.core.errors import FaultPlanError
from phalanx.serve.serving_faults import load_serving_faults


def test_straggler_kill_and_freeze_parse(tmp_path):
    p = tmp_path / "plan.toml"
    p.write_text('[[fault]]\nkind = "straggler"\nworker = 3\nat_s = 0\nfactor = 10\n\n'
                 '[[fault]]\nkind = "kill"\nworker = 1\nat_s = 2.5\n')
    faults = load_serving_faults(p)
    assert [(f.kind, f.replica, f.at_s) for f in faults] == [("straggler", 3, 0.0), ("kill", 1, 2.5)]
    assert faults[0].factor == 10


def test_unsupported_kind_is_refused_with_file_and_line(tmp_path):
    p = tmp_path / "plan.toml"
    p.write_text('[[fault]]\nkind = "kill"\nworker = 0\nat_s = 1\n\n[[fault]]\nkind = "coordinator_kill"\nat_s = 1\n')
    with pytest.raises(FaultPlanError) as e:
        load_serving_faults(p)
    assert str(p) in str(e.value) and ":6" in str(e.value) and "not supported when serving" in str(e.value)


def test_every_serving_kind_parses_with_its_target_and_parameters(tmp_path):
    p = tmp_path / "plan.toml"
    p.write_text('[[fault]]\nkind = "freeze"\nworker = 0\nat_s = 1\nfor_s = 2\n\n'
                 '[[fault]]\nkind = "hang"\nworker = 1\nat_s = 1\nfor_s = 2\n\n'
                 '[[fault]]\nkind = "partition"\nisolate = 2\nat_s = 1\nfor_s = 2\n\n'
                 '[[fault]]\nkind = "latency"\nworkers = [0, 3]\nmean_ms = 50\nat_s = 1\n\n'
                 '[[fault]]\nkind = "loss"\nworker = 1\nprobability = 0.1\nat_s = 1\n')
    faults = load_serving_faults(p, replicas=4)
    assert [(f.kind, f.replica) for f in faults] == [("freeze", 0), ("hang", 1), ("partition", 2), ("latency", 0),
                                                     ("latency", 3), ("loss", 1)]
    assert dict(faults[3].params) == {"mean_ms": 50} and dict(faults[5].params) == {"probability": 0.1}


def test_a_replica_the_run_does_not_have_is_refused_with_file_and_line(tmp_path):
    p = tmp_path / "plan.toml"
    p.write_text('[[fault]]\nkind = "kill"\nworker = 0\nat_s = 1\n\n[[fault]]\nkind = "kill"\nworker = 7\nat_s = 1\n')
    with pytest.raises(FaultPlanError) as e:
        load_serving_faults(p, replicas=4)
    assert str(p) in str(e.value) and ":6" in str(e.value) and "replica 7 does not exist" in str(e.value)
