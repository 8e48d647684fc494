"""PHALANX_SPECULATE=on on real processes: steps go on before their verdicts, and a kill or a
freeze (whose aborts can land on a step some members already speculated past) still ends with
the single-process reference's model and every sample used exactly once. Which steps are taken
back depends on where the signal lands; the scripted cases are in tests/train/test_speculation.py."""

import json

from tests.integration.conftest import assert_strict, train

PACE = {"min_step_s": 0.08}


def _speculated(run_dir) -> int:
    n = 0
    for f in (run_dir / "workers").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            n += r.get("span") == "allreduce" and bool(r.get("speculative"))
    return n


def test_speculating_workers_survive_a_kill_and_a_freeze_and_stay_strict(tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_SPECULATE", "on")
    plan = ('[[fault]]\nkind = "kill"\nworker = 1\nat_step = 8\nrestart = true\n'
            '[[fault]]\nkind = "freeze"\nworker = 2\nat_step = 30\nfor_s = 1.5\n')
    s = train(tmp_path, plan, workers=3, steps=60, **PACE)
    assert_strict(s)
    assert s["steps_retried"] >= 1
    assert _speculated(tmp_path / "run") > 60  # over a third of the 3 x 60 votes went on before their verdict
