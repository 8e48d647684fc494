"""A model on the GPU trains through phalanx: its gradients go through NCCL (or, where workers
share one GPU, Gloo on CUDA tensors, which the ranks agree on: NCCL refuses two ranks on one GPU), a SIGKILLed worker
is restarted and healed with CUDA parameters, and the workers agree. Runs where a GPU is present
(CI has none; the lead runs it on a lent GPU machine)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from phalanx.faults.plan import parse_fault_plan
from phalanx.runtime.launcher import LaunchConfig, launch, python_argv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PLAN = '[[fault]]\nkind = "kill"\nworker = 1\nat_step = 10\nrestart = true\n'


def test_a_cuda_model_trains_through_a_kill_and_the_workers_agree(tmp_path):
    cfg = LaunchConfig(argv=python_argv("phalanx.bench.phx_worker", "30", "mlp-6m", "cuda"), workers=2,
                       run_dir=tmp_path, restart_failed=True, total_steps=30, show_progress=False,
                       fault_plan=parse_fault_plan(PLAN, "<cuda>"))
    res = launch(cfg)
    assert res.ok, res.reason
    assert len(res.commits) == 30 and res.steps_retried >= 1
    reports = [json.loads(p.read_text()) for p in sorted((tmp_path / "workers").glob("*.steps.json"))]
    assert reports and all(r["device"].startswith("cuda") for r in reports)
    assert all(math.isfinite(r["final_loss"]) for r in reports if r["step_s"])
    assert len({r["params_sha256"] for r in reports}) == 1  # one final model on every worker
