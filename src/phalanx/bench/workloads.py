"""The training benchmark's models, the same for plain DDP and phalanx: the bundled char-level
transformer, and plain MLPs of about 6 M and 25 M parameters on a fixed synthetic dataset (the
sizes the fast-path issue measured). Each gives (model, optimizer, batch(indices) -> (x, y), loss)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# name -> (input width, hidden width, hidden layers, output width)
MLPS = {"mlp-6m": (256, 1350, 4, 256), "mlp-25m": (512, 2720, 4, 512)}  # 6.2 M and 25.0 M parameters
WORKLOADS = ("charlm", *MLPS)
MLP_DATASET = 2048
MLP_GLOBAL_BATCH = 64


@dataclass
class Workload:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    dataset_size: int
    global_batch_size: int
    batch: Callable[[Any], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def build(name: str, device: str = "cpu") -> Workload:
    """The workload ``name`` with its model and batches on ``device`` ("cpu", "cuda", "cuda:1")."""
    dev = torch.device(device)
    if name == "charlm":
        from phalanx.workload.charlm_train import build as build_charlm
        from phalanx.workload.model import build_model, build_optimizer, loss_fn

        cfg, data = build_charlm()
        model = build_model(cfg).to(dev)

        def lm_batch(idx: Any) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = data.batch(idx)
            return x.to(dev), y.to(dev)

        return Workload(model, build_optimizer(model, cfg), len(data), cfg.global_batch_size,
                        data.batch if dev.type == "cpu" else lm_batch, loss_fn)
    if name not in MLPS:
        raise ValueError(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")
    d_in, hidden, layers, d_out = MLPS[name]
    torch.manual_seed(0)
    widths = [d_in, *[hidden] * layers, d_out]
    mods: list[nn.Module] = []
    for i in range(len(widths) - 1):
        mods.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            mods.append(nn.ReLU())
    model = nn.Sequential(*mods).to(dev)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(MLP_DATASET, d_in, generator=g).to(dev)
    y = torch.randn(MLP_DATASET, d_out, generator=g).to(dev)

    def batch(idx: Any) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tensor(idx, dtype=torch.long, device=dev)  # a copy: the indices may be a read-only view
        return x[t], y[t]

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return Workload(model, opt, MLP_DATASET, MLP_GLOBAL_BATCH, batch, nn.functional.mse_loss)
