"""The one layout of what a step all-reduces, shared by real runs and the simulator.

A step all-reduces its gradients ``* n_i/N`` in buckets (summed over the quorum: the global-batch
mean gradient), the last of which carries a small tail ``[coverage | loss * n_i/N]`` after its
gradients (in its own buffer only when that bucket's dtype cannot hold it): the coverage vector (global-batch
position -> sample index + 1, each member filling only its own slice, so the sum equals the batch
exactly when every sample was used once) and the global-batch mean loss. A local-sgd merge's buffer is
``[params * w_i | w_i | loss * w_i]``: the weighted average of parameters. Both are numpy views
here (a torch tensor's ``.numpy()`` shares its memory), so one implementation serves both sides.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from phalanx.train import sharding


@dataclass(frozen=True)
class TailLayout:
    """The small buffer that travels after a step's gradient buckets: a ``global_batch_size``
    coverage vector and one loss value."""

    global_batch_size: int

    @property
    def size(self) -> int:
        return self.global_batch_size + 1

    def fill(self, buf: np.ndarray, offset: int, indices: np.ndarray, loss: float, share: float) -> None:
        """Write this member's coverage slice and its share of the loss."""
        cov = buf[: self.global_batch_size]
        cov.fill(0)
        if len(indices):
            mine = cov[offset : offset + len(indices)]
            mine[:] = indices  # cast to the buffer's dtype, then + 1 in it
            mine += 1
        buf[-1] = loss * share

    def verify(self, buf: np.ndarray, expected: np.ndarray | None) -> tuple[bool, float]:
        """After the sum: (global batch covered exactly once, global mean loss). ``expected`` holds
        indices + 1, finite and non-zero, where two equal values of one dtype have equal bytes:
        comparing the bytes gives np.array_equal's answer for a fraction of its cost."""
        cov = buf[: self.global_batch_size]
        if expected is None:
            ok = False
        elif cov.dtype == expected.dtype and cov.shape == expected.shape:
            ok = cov.tobytes() == expected.tobytes()
        else:
            ok = bool(np.array_equal(cov, expected))
        return ok, float(buf[-1])


def expected_coverage(step: int, dataset_size: int, global_batch_size: int, data_seed: int,
                      dtype: type = np.float32) -> np.ndarray:
    """What the summed coverage vector must equal: the step's global batch, each index + 1."""
    return np.asarray(sharding.global_batch(step, dataset_size, global_batch_size, data_seed), dtype=dtype) + 1


@dataclass(frozen=True)
class MergeLayout:
    """A local-sgd merge: ``n_params`` weighted parameters, the weight, the weighted loss."""

    n_params: int

    @property
    def size(self) -> int:
        return self.n_params + 2

    @staticmethod
    def fill_tail(buf: np.ndarray, weight: float, loss: float) -> None:
        buf[-2] = weight
        buf[-1] = loss * weight

    @staticmethod
    def verify(buf: np.ndarray) -> tuple[bool, float]:
        """No global batch to cover in a merge; the loss is the weighted mean."""
        return False, float(buf[-1] / buf[-2])

    @staticmethod
    def total_weight(buf: np.ndarray) -> float:
        return float(buf[-2])
