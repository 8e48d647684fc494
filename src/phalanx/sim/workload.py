"""The simulated workers' model: a small linear regression trained with SGD in numpy.

Real arithmetic, so the invariants are real: every worker that commits step s holds bit-identical
parameters, and the run can be compared with a single-process reference. The gradient of a shard is
pre-scaled by shard/global batch, so the all-reduced sum is the global-batch mean gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from phalanx.train import sharding


@dataclass(frozen=True)
class SimModelConfig:
    features: int = 16
    dataset_size: int = 4096
    global_batch_size: int = 256
    lr: float = 0.05
    seed: int = 0
    grad_buckets: int = 2  # the gradient travels in this many buckets, then the coverage tail
    # True: bucket k of B starts at compute * (k+1)/B, during the compute, as autograd hooks start
    # them during a real backward (job.track(overlap=True)); False: all after the compute
    overlap: bool = False


class RegressionData:
    def __init__(self, cfg: SimModelConfig) -> None:
        rng = np.random.Generator(np.random.PCG64(cfg.seed))
        self.cfg = cfg
        self.x = rng.standard_normal((cfg.dataset_size, cfg.features))
        w_true = rng.standard_normal(cfg.features)
        self.y = self.x @ w_true + 0.1 * rng.standard_normal(cfg.dataset_size)

    def initial_params(self) -> np.ndarray:
        return np.zeros(self.cfg.features)

    def shard_gradient(self, w: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, float]:
        """(gradient, loss) contributions of these samples, each scaled by 1/global batch."""
        gbs = self.cfg.global_batch_size
        if len(idx) == 0:  # more workers than samples (1,024 on a batch of 256): the same zeros, fast
            return np.zeros(self.cfg.features), 0.0
        # take and dot: the same BLAS calls, bit for bit, as x[idx] and xs.T @ err, for less per call
        xs = self.x.take(idx, axis=0)
        err = np.dot(xs, w) - self.y.take(idx)
        return np.dot(err, xs) * (2.0 / gbs), float(np.dot(err, err)) / gbs


def reference_params(cfg: SimModelConfig, steps: int) -> tuple[np.ndarray, list[float]]:
    """Single-process training over the same global batches."""
    data = RegressionData(cfg)
    w = data.initial_params()
    losses = []
    for s in range(steps):
        idx = sharding.global_batch(s, cfg.dataset_size, cfg.global_batch_size, cfg.seed)
        g, loss = data.shard_gradient(w, idx)
        w = w - cfg.lr * g
        losses.append(loss)
    return w, losses
