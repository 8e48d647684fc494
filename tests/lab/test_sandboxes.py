"""Fallacy sandboxes: the secure-network and one-administrator experiments' claims, measured."""

import json

from tests.lab.helpers import run_quick


def test_forged_frame_is_delivered_without_authentication_and_refused_with_it(tmp_path):
    o = run_quick("fallacy-secure-network", tmp_path, sim=False)
    on, off = o.data["authentication ON"], o.data["authentication OFF"]
    assert off["forged_accepted"] == 1, off
    assert on["forged_accepted"] == 0 and on["handshake"].startswith("refused"), on
    assert on["genuine_accepted"] == 1 and on["rejections"] >= 1
    assert o.claim_held
    doc = json.loads((tmp_path / "fallacy-secure-network" / "results.json").read_text())
    assert doc["claim_held"] and (tmp_path / "fallacy-secure-network" / "report.html").exists()


def test_someone_elses_folder_loses_files_only_without_the_ownership_check(tmp_path):
    o = run_quick("fallacy-one-administrator", tmp_path, sim=False)
    on, off = o.data["ownership check ON"], o.data["ownership check OFF"]
    assert on["files_deleted"] == 0 and "phalanx did not create it" in on["refused"]
    assert off["files_deleted"] > 0 and "report.html" in off["deleted"]
    assert o.claim_held
