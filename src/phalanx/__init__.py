"""phalanx: a cluster of processes that trains one PyTorch model like one reliable machine.

The user-facing API lives in :mod:`phalanx.train.api`; ``phalanx.join()`` (runtime/worker_join.py)
is the entry point inside a script started by ``phalanx launch``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from phalanx.core.errors import FinalStateUnavailable, JobFailed, PhalanxError

__version__ = "0.1.0"

if TYPE_CHECKING:
    from phalanx.train.api import Job


def join(**overrides: Any) -> "Job":
    """Join the cluster this process was started into by ``phalanx launch``."""
    from phalanx.runtime.worker_join import join as _join

    return _join(**overrides)


__all__ = ["join", "FinalStateUnavailable", "JobFailed", "PhalanxError", "__version__"]
