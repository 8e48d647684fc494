"""Which torch backend moves which tensor: Gloo for CPU tensors, NCCL for CUDA ones (made on the
quorum's first CUDA tensor), so a CPU model trains on a machine with GPUs; PHALANX_BACKEND=gloo
sends CUDA tensors through Gloo too. Real groups, formed through the factory and the signed store,
in two processes; the CUDA cases run where a GPU is present."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from phalanx.collectives.process_group import RendezvousStore, TorchProcessGroupFactory, backend_for, cuda_backend
from phalanx.core.errors import ConfigError


def test_auto_is_nccl_for_cuda_tensors_and_gloo_for_the_rest():
    assert backend_for("auto", "cpu") == "gloo"
    assert backend_for("auto", "cuda") == "nccl"
    assert backend_for("gloo", "cuda") == "gloo"
    assert backend_for("gloo", "cpu") == "gloo"


def test_ranks_sharing_a_gpu_use_gloo_for_cuda_tensors_since_nccl_refuses_them():
    assert cuda_backend(["a/GPU-1", "a/GPU-2", "b/GPU-1"]) == "nccl"
    assert cuda_backend(["a/GPU-1", "a/GPU-1"]) == "gloo"


def test_an_unknown_backend_setting_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="PHALANX_BACKEND='mpi'.*auto, gloo"):
        backend_for("mpi", "cpu")
    with pytest.raises(ConfigError, match="'nccl'"):  # refused before the factory connects anywhere
        TorchProcessGroupFactory("127.0.0.1:1", b"k" * 32, backend="nccl")


_RANK = r"""
import asyncio, json, os, sys
import torch
from phalanx.collectives.process_group import TorchProcessGroupFactory

rank, address, setting, device = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]

async def main():
    factory = TorchProcessGroupFactory(address, b"t" * 32, backend=setting, run_id="backends")
    group = await factory.create(7, rank, 2, 60.0)
    cpu = torch.full((5,), float(rank + 1))
    await group.allreduce_sum(cpu, 60.0)
    out = {"cpu": cpu.tolist(), "backends": []}
    if device != "none":
        dev = torch.device(device)
        t = torch.full((1 << 20,), float(rank + 1), device=dev)  # 4 MB on the GPU
        await group.start_allreduce_sum(t).wait(60.0)
        out["cuda"] = [t[0].item(), t[-1].item()]
    out["backends"] = group.backends
    group.abandon()
    print("RESULT " + json.dumps(out), flush=True)

asyncio.run(main())
os._exit(0)  # as a worker does: no interpreter teardown racing torch's own threads
"""


def _run_pair(setting: str, devices: list[str]) -> list[dict]:
    store = RendezvousStore("127.0.0.1")
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), store.address, setting, devices[r]],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    return [json.loads(next(line for line in o[0].splitlines() if line.startswith("RESULT "))[7:]) for o in outs]


def test_two_ranks_sum_cpu_tensors_over_gloo_through_the_factory():
    for r in _run_pair("auto", ["none", "none"]):
        assert r["cpu"] == [3.0] * 5
        assert r["backends"] == ["gloo"]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _devices() -> list[str]:
    n = torch.cuda.device_count()
    return [f"cuda:{r % n}" for r in range(2)]


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one GPU: see the shared-GPU case")
def test_cuda_tensors_go_through_nccl_and_cpu_ones_through_gloo_in_one_quorum():
    for r in _run_pair("auto", _devices()):
        assert r["cpu"] == [3.0] * 5 and r["cuda"] == [3.0, 3.0]
        assert r["backends"] == ["gloo", "nccl"]


@needs_cuda
def test_ranks_on_one_gpu_agree_on_gloo_for_cuda_tensors_instead_of_failing_in_nccl():
    for r in _run_pair("auto", ["cuda:0", "cuda:0"]):
        assert r["cpu"] == [3.0] * 5 and r["cuda"] == [3.0, 3.0]
        assert r["backends"] == ["gloo"]


@needs_cuda
def test_gloo_setting_sums_cuda_tensors_through_gloo():
    for r in _run_pair("gloo", _devices()):
        assert r["cuda"] == [3.0, 3.0]
        assert r["backends"] == ["gloo"]
