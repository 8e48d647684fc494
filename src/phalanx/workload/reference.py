"""The fault-free single-process reference over the same global batches."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from phalanx.train import sharding
from phalanx.workload.corpus import CharDataset
from phalanx.workload.model import CharLMConfig, build_model, build_optimizer, loss_fn


@dataclass(frozen=True)
class ReferenceResult:
    params: dict[str, torch.Tensor]
    losses: list[float]
    wall_s: float

    @property
    def final_loss(self) -> float:
        return self.losses[-1]


def train_reference(cfg: CharLMConfig, dataset: CharDataset, steps: int, data_seed: int,
                    on_step: Callable[[int, float], None] | None = None) -> ReferenceResult:
    t0 = time.monotonic()
    model = build_model(cfg)
    opt = build_optimizer(model, cfg)
    losses = []
    for step in range(steps):
        x, y = dataset.batch(sharding.global_batch(step, len(dataset), cfg.global_batch_size, data_seed))
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if on_step:
            on_step(step, losses[-1])
    return ReferenceResult({k: v.detach().clone() for k, v in model.state_dict().items()}, losses,
                           time.monotonic() - t0)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise ValueError(f"parameter names differ: {sorted(set(a) ^ set(b))[:5]}")
    worst = 0.0
    for k in a:
        if a[k].shape != b[k].shape:
            raise ValueError(f"{k}: shape {tuple(a[k].shape)} vs {tuple(b[k].shape)}")
        worst = max(worst, float((a[k].double() - b[k].double()).abs().max()))
    return worst
