"""Speculative commit for small models: the user's thread goes on while the verdict travels.

A step's all-reduce completes on a member only once every member has put its share in, and the
summed coverage vector says whether the global batch was used exactly once. From that moment the
coordinator commits the step unless the quorum breaks first (a member lost between its collective
and its report, a partition, a coordinator that dies). On a fault-free step, waiting for the
verdict is a round trip through the coordinator (1-2 ms on loopback, more across a network)
during which every member sits idle, unless the wait is the box's own CPU work.

So, with ``PHALANX_SPECULATE=on`` (opt-in: see ``setting_from_env``), for a tracked model whose
parameters and optimizer state are small enough that copying them costs well under that round
trip (``max_bytes``), the bridge (train/api.py) lets
``allreduce_gradients`` return True at that moment, takes a ``StateSnapshot`` before the optimizer
steps, and runs the next step's body on a *guess* of its grant (the same quorum, the next step)
while the verdict travels. Nothing a peer sees depends on the guess: the guessed step's
collectives start only once the verdict is in and its grant matches the guess. When the verdict
is an abort, the snapshot (and the random-number state) goes back and the aborted step runs again;
when the grant differs from the guess, the guessed body runs again on the real grant. The engine,
the agent and the coordinator are unchanged: a step is still committed only by the coordinator's
decision for its quorum id, and only committed state is ever healed from or checkpointed (a
speculating step never asks for a heal or a checkpoint: the fast path's grant excludes both).

What a user sees: a True from ``allreduce_gradients`` may be taken back; the next step's
``allreduce_gradients`` then returns False and the loop runs the earlier step again, with the model
and optimizer as they were before it.
"""

from __future__ import annotations

import concurrent.futures
import os
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.core.errors import ConfigError
from phalanx.train.assignment import Assignment
from phalanx.train.step_engine import Ticket

# Above this, copying parameters and optimizer state each step costs about what the verdict's round
# trip does (a few GB/s of memcpy on a small box: 4 MiB is ~1 ms).
DEFAULT_MAX_BYTES = 4 * 1024 * 1024
ADAM_LIKE_STATE = 2  # tensors of optimizer state per parameter assumed before the first step
SETTINGS = ("off", "on")


def setting_from_env() -> str:
    """``PHALANX_SPECULATE``: ``off`` (the default) or ``on`` (every step it can, for a model
    within DEFAULT_MAX_BYTES). Off by default because it pays only where the verdict's wait is
    idle time: with 1 ms of link latency it took 7-10 % off a step; on loopback with every core
    busy that wait is CPU work the next step only competes with, and it cost 2-6 %."""
    raw = os.environ.get("PHALANX_SPECULATE", "off").strip().lower()
    if raw not in SETTINGS:
        raise ConfigError(f"PHALANX_SPECULATE={raw!r}: use one of {', '.join(SETTINGS)}")
    return raw


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class StateSnapshot:
    """Parameters, optimizer state and optimizer hyperparameters, copied before a speculative
    optimizer step and put back if that step is aborted. Buffers are kept across steps (a copy, no
    allocation, once the state's shapes settle)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.optimizer, self.max_bytes = optimizer, max_bytes
        self._params = list(model.parameters())
        self._bufs: list[torch.Tensor] = []
        self._live: list[torch.Tensor] = []  # what _bufs were copied from, in order
        self._state: list[tuple[Any, dict[str, Any]]] = []  # (param, its state: tensors as buffers)
        self._groups: list[dict[str, Any]] = []

    @classmethod
    def fits(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, max_bytes: int) -> bool:
        """Worth it: parameters plus (an Adam-like guess at, or the actual) optimizer state within
        ``max_bytes``, all on the CPU (a device copy would add a synchronisation)."""
        if optimizer is None:
            return False
        params = list(model.parameters())
        if any(p.device.type != "cpu" for p in params):
            return False
        return sum(_nbytes(p) for p in params) * (1 + ADAM_LIKE_STATE) <= max_bytes

    def take(self) -> bool:
        """Copy the current state. False (nothing taken) when it has grown past ``max_bytes``."""
        # parameters through .data: copying back must not bump their autograd version counters
        live: list[torch.Tensor] = [p.data for p in self._params]
        state: list[tuple[Any, dict[str, Any]]] = []
        for p, st in self.optimizer.state.items():
            entry: dict[str, Any] = {}
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    entry[k] = len(live)
                    live.append(v)  # the optimizer's own tensor (restore puts it back by identity)
                else:
                    entry[k] = ("value", v)
            state.append((p, entry))
        if sum(_nbytes(t) for t in live) > self.max_bytes or any(t.device.type != "cpu" for t in live):
            return False
        if len(live) != len(self._bufs) or any(b.shape != t.shape or b.dtype != t.dtype
                                               for b, t in zip(self._bufs, live)):
            self._bufs = [torch.empty_like(t) for t in live]
        torch._foreach_copy_(self._bufs, live)
        self._live, self._state = live, state
        self._groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return True

    def restore(self) -> None:
        """Put back what ``take`` copied: the parameters in place, the optimizer's state as it was
        (a parameter that had none has none again), its hyperparameters."""
        torch._foreach_copy_(self._live, self._bufs)
        opt = self.optimizer
        had = {id(p) for p, _ in self._state}
        for p in [p for p in opt.state if id(p) not in had]:
            del opt.state[p]
        for p, entry in self._state:
            st = opt.state[p]
            for k in [k for k in st if k not in entry]:
                del st[k]
            for k, v in entry.items():
                if isinstance(v, tuple):
                    st[k] = v[1]
                else:
                    st[k] = self._live[v]  # the tensor it had (if the optimizer replaced it since)
        for g, saved in zip(opt.param_groups, self._groups):
            g.update(saved)


@dataclass
class Pending:
    """A step that returned True before its verdict: the verdict's future (a ``Vote``), and what
    settling it needs."""

    step: Any  # the api.Step whose verdict travels
    vote: concurrent.futures.Future[Any]
    samples: int
    rng: torch.Tensor | None = None  # the random-number state before that step's body

    def guess(self) -> Ticket:
        """The next step on the same quorum: what the fast path grants when nothing changes. No
        exchange: its collectives wait for the real grant."""
        a = self.step._a
        return Ticket(a._replace(step=a.step + 1), a.step + 1)


def same_body(granted: Assignment, guessed: Assignment) -> bool:
    """The grant asks the body for exactly what the guess did (same step, quorum, rank, shard)."""
    return (granted.step == guessed.step and granted.quorum_id == guessed.quorum_id
            and granted.members == guessed.members and granted.rank == guessed.rank
            and granted.shard_span == guessed.shard_span)


def settle_once(fut: concurrent.futures.Future[Any], value: Any) -> None:
    try:
        fut.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass  # the other side settled it first
