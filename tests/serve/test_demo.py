"""`phalanx serve --demo RUN_DIR` (the serving step of `make demo`): policies side by side through faults."""

from __future__ import annotations

import json

import pytest

from phalanx.serve.demo import POLICIES, run_demo

pytestmark = pytest.mark.slow


def test_demo_serves_every_policy_through_kill_freeze_and_straggler_and_writes_the_report(tmp_path):
    code = run_demo(tmp_path, checkpoint=str(tmp_path / "no-such-run"), duration_s=6.0)
    res = json.loads((tmp_path / "serve-demo" / "results.json").read_text())
    assert [f["kind"] for f in res["faults"]] == ["straggler", "kill", "freeze"]
    assert set(res["policies"]) == {name for name, _, _ in POLICIES}
    assert all(p["ok"] > 0 and p["errors"] == 0 for p in res["policies"].values()) and code == 0
    html = (tmp_path / "serve-demo" / "report.html").read_text()
    assert "data:image/png;base64," in html and "p2c-latency+hedge" in html
