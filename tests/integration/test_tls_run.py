"""A real training run with the control plane and heals under mutual TLS (PHALANX_TLS_* for the
launcher and every worker), through a kill and a heal: still strict-equal to the reference."""

import shutil

import pytest

from tests.integration.conftest import assert_strict, train
from tests.transport.test_tls import _ca, _node


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_training_over_mutual_tls_survives_a_kill_and_heals(tmp_path, monkeypatch):
    _ca(tmp_path, "cluster")
    tls = _node(tmp_path, "cluster", "node")
    monkeypatch.setenv("PHALANX_TLS_CERT", tls.cert_file)
    monkeypatch.setenv("PHALANX_TLS_KEY", tls.key_file)
    monkeypatch.setenv("PHALANX_TLS_CA", tls.ca_file)
    plan = '[[fault]]\nkind = "kill"\nworker = 1\nat_step = 5\nrestart = true\n'
    s = train(tmp_path, plan, workers=3, steps=40, min_step_s=0.08)
    assert_strict(s)
