"""The 3-minute soak of `make test-slow`, which CI runs (`make soak` runs it for 30 minutes): random
faults of every kind one after another and hostile connections at every listening port, then every
long-run check."""

import json

import pytest

from phalanx.runtime.soak import KINDS, run_soak


@pytest.mark.slow
@pytest.mark.timeout(900)  # 3 minutes of faults, plus start, the reference run and the checks
def test_a_short_soak_survives_every_fault_kind_and_every_hostile_connection(tmp_path):
    res = run_soak(180.0, tmp_path / "soak", seed=1, show_progress=False)
    assert res["ok"], json.dumps(res, indent=2)
    assert set(res["fault_kinds"]) == set(KINDS)  # every kind fired at least once
    assert res["hostile_connections"] >= 50 and res["hostile_refused"] == res["hostile_connections"]
    assert res["samples_exactly_once"] and not res["leaked_processes"] and not res["new_temp_files"]
    assert (tmp_path / "soak" / "soak.md").exists()
