"""The lab's real-process experiments and the `phalanx lab` command."""

import json

import pytest

from phalanx.cli.main import main
from tests.lab.helpers import run_quick


def test_lab_lists_every_experiment(capsys):
    assert main(["lab"]) == 0
    out = capsys.readouterr().out
    for name in ("latency", "partial-failure", "cap", "one-in-a-thousand", "serving-tail", "fallacy-secure-network"):
        assert name in out


def test_an_unknown_experiment_is_refused_with_the_list(capsys):
    assert main(["lab", "no-such-thing"]) == 2
    assert "phalanx lab` lists them" in capsys.readouterr().err


def test_lab_writes_report_and_results_and_refuses_a_foreign_folder(tmp_path, capsys):
    out = tmp_path / "secure"
    assert main(["lab", "fallacy-secure-network", "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["claim_held"] and "forged" in doc["paragraph"]
    assert "Question." in (out / "report.html").read_text()
    foreign = tmp_path / "theirs"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("keep me")
    assert main(["lab", "fallacy-secure-network", "--out", str(foreign)]) == 2
    assert (foreign / "thesis.tex").read_text() == "keep me"


@pytest.mark.slow
def test_a_worker_leaving_for_good_stops_a_fixed_world_but_not_the_elastic_quorum(tmp_path):
    o = run_quick("fallacy-fixed-topology", tmp_path, sim=False)
    e, f = o.data["elastic quorum"], o.data["fixed world OFF"]
    assert e["steps_committed"] == e["steps"]
    assert e["ok"], e["reason"]  # w2, killed for good by the plan, departed: it did not fail
    assert f["steps_committed"] < f["steps"] and not f["ok"]


@pytest.mark.slow
def test_latency_real_point_slows_the_step_with_and_without_overlap(tmp_path):
    o = run_quick("latency", tmp_path, sim=False)
    real = o.data["real_point"]
    assert set(real) == {"overlap", "no overlap"}
    for r in real.values():
        assert r["slowdown"] is not None and r["slowdown"] > 1.0, real
    assert (tmp_path / "latency" / "jobs" / "real-5ms-no-overlap").is_dir()


@pytest.mark.slow
def test_naive_round_robin_tail_follows_the_slow_replica_and_p2c_latency_avoids_it(tmp_path):
    o = run_quick("serving-tail", tmp_path, sim=False)
    res = o.data["results"]
    assert res["round-robin"]["latency_s"]["p99"] > 2 * res["healthy"]["latency_s"]["p99"]  # the slow backlog
    assert res["p2c-latency"]["latency_s"]["p99"] < res["round-robin"]["latency_s"]["p99"]
