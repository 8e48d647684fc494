"""Gradient buckets: all-reduce during backward, into buffers the ``.grad`` tensors are views of.

What DDP's reducer does, for the tracked model: parameters are grouped, in reverse registration
order (roughly the order backward produces their gradients), into flat buckets of at most
``bucket_bytes``. A post-accumulate-grad hook on each parameter of every bucket but the last counts
its bucket down (the last completes as backward ends, and ``finish`` starts it); when a
bucket is complete (and every bucket before it has started: every rank must start its collectives
in the same order) it is scaled by this worker's share of the global batch and its all-reduce
starts at once, while backward goes on with earlier layers. Once a parameter's ``.grad`` is a view
of its bucket, autograd accumulates into the bucket itself and the reduced sum lands where the
optimizer reads it: no flatten, no copy back. (An optimizer's ``zero_grad(set_to_none=True)``
drops the view; the next hook copies the fresh gradient in and re-points ``.grad``: one copy, inside
backward, as DDP does.)

The buckets are built once and reused by every step that commits; after one that does not, they
get fresh memory (an abandoned collective may still write into the old). The gradients of one step must
come from one backward pass: a second one would add into a bucket already on the wire, so it is
refused with a clear error (``job.track(..., overlap=False)`` for gradient accumulation). Into the
last bucket, not yet sent, it adds as plain torch would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from phalanx.core.errors import ConfigError
from phalanx.train.step_buffer import TailLayout

# DDP's default (bucket_cap_mb=25). Against 8 MiB, on 2 cores with 4 workers, in alternating runs:
# the 6 M MLP 156.3 -> 148.4 ms a step, the 25 M MLP 673.5 -> 635.9 ms (fewer collectives, each
# with its fixed hops and thread switches); 2 MiB was slower still (159.9). The bundled model's
# 0.47 MB gradient is one bucket either way.
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


@dataclass
class _Bucket:
    index: int
    flat: torch.Tensor
    params: list[torch.nn.Parameter]
    views: list[torch.Tensor]
    numel: int
    started: bool = False
    seen: set[int] = field(default_factory=set)  # positions whose gradient arrived this step


class GradientBuckets:
    def __init__(self, params: list[torch.nn.Parameter], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if bucket_bytes <= 0:
            raise ConfigError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.params = [p for p in params if p.requires_grad]
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[_Bucket, int]] = {}  # id(param) -> (bucket, position in it)
        self._build(bucket_bytes)
        self.total_numel = sum(b.numel for b in self.buckets)
        self._exchange: Any = None  # armed for a step: its Exchange
        self._share = 0.0
        self._next = 0  # the next bucket index to start (in order)
        self.error = ""
        # > 0: the last bucket's buffer carries the step's tail ([coverage | loss]) after its
        # gradients, and starts with it once the tail is filled (one collective fewer a step)
        self.tail_size = 0
        # No hooks on the last bucket: it completes as backward ends, and finish() starts it (with the
        # tail it carries) right after; its hooks would only cost a Python call per parameter a step
        # (0.25 ms of a worker's CPU for the bundled model, one bucket). Its gradients are adopted there.
        early = [p for b in self.buckets[:-1] for p in b.params]
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in early]

    def _build(self, bucket_bytes: int) -> None:
        groups: list[list[torch.nn.Parameter]] = []
        size = 0
        for p in reversed(self.params):
            nbytes = p.numel() * p.element_size()
            same_kind = groups and groups[-1][0].dtype == p.dtype and groups[-1][0].device == p.device
            if not groups or not same_kind or size + nbytes > bucket_bytes:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += nbytes
        for i, ps in enumerate(groups):
            n = sum(p.numel() for p in ps)
            flat = torch.zeros(n, dtype=ps[0].dtype, device=ps[0].device)
            views, pos = [], 0
            for p in ps:
                views.append(flat[pos : pos + p.numel()].view_as(p))
                pos += p.numel()
            b = _Bucket(i, flat, ps, views, n)
            for j, p in enumerate(ps):
                self._where[id(p)] = (b, j)
            self.buckets.append(b)

    @property
    def device(self) -> torch.device:
        return self.buckets[0].flat.device if self.buckets else torch.device("cpu")

    # ---- one step ----
    def arm(self, exchange: Any, share: float, tail_size: int = 0) -> None:
        """The step's shard is known: buckets completed from now on start their all-reduce. With
        ``tail_size``, the last bucket makes room for the tail (when its dtype holds the coverage's
        integers exactly) and waits for it (``tail_view``, then ``finish``)."""
        self._exchange, self._share = exchange, share
        self._next, self.error = 0, ""
        carries = tail_size > 0 and bool(self.buckets) and self.buckets[-1].flat.dtype in (torch.float32, torch.float64)
        self.tail_size = tail_size if carries else 0
        if self.tail_size:
            self._reserve_tail(self.tail_size)
        for b in self.buckets:
            b.started = False
            b.seen.clear()

    def _reserve_tail(self, n: int) -> None:
        """Give the last bucket room for an ``n``-long tail (once, or when n changes). A ``.grad``
        still on the old memory is copied in by the next hook, as after ``zero_grad``."""
        b = self.buckets[-1]
        if b.flat.numel() == b.numel + n:
            return
        b.flat = torch.zeros(b.numel + n, dtype=b.flat.dtype, device=b.flat.device)
        pos = 0
        for j, p in enumerate(b.params):
            b.views[j] = b.flat[pos : pos + p.numel()].view_as(p)
            pos += p.numel()

    def tail_view(self) -> torch.Tensor | None:
        """Where this step's tail goes (fill it before ``finish``), or None: it travels alone."""
        if not self.tail_size:
            return None
        b = self.buckets[-1]
        return b.flat[b.numel :]

    @property
    def armed(self) -> bool:
        return self._exchange is not None

    def disarm(self) -> None:
        self._exchange = None

    def _on_grad(self, p: torch.Tensor) -> None:
        """Autograd's post-accumulate hook (on the backward's thread)."""
        if self._exchange is None:
            return
        b, j = self._where[id(p)]
        if b.started or j in b.seen:
            self.error = ("a parameter's gradient arrived twice in one step (a second backward, or a "
                          "parameter used after its bucket was sent): call backward once per step, or "
                          "job.track(..., overlap=False) to accumulate gradients")
            return
        self._adopt(b, j)
        b.seen.add(j)
        self._start_ready()

    def _adopt(self, b: _Bucket, j: int) -> None:
        """Make the parameter's ``.grad`` the bucket's view (copying a fresh gradient in)."""
        p, view = b.params[j], b.views[j]
        g = p.grad
        if g is None:
            view.zero_()
        elif g.data_ptr() != view.data_ptr():
            view.copy_(g)
        p.grad = view

    def _start_ready(self) -> None:
        while self._next < len(self.buckets) - 1:  # the last one: finish() starts it (and its tail)
            b = self.buckets[self._next]
            if len(b.seen) < len(b.params):
                return
            self._start(b)

    def _start(self, b: _Bucket) -> None:
        b.started = True
        (b.flat[: b.numel] if b.flat.numel() != b.numel else b.flat).mul_(self._share)  # not the tail
        self._exchange.launch(b.flat, b.numel / max(self.total_numel, 1))
        self._next += 1

    def finish(self) -> str:
        """After backward: start every bucket not started yet, in order (parameters without a
        gradient this step contribute zeros). Returns the error, if the step's gradients were
        unusable ("" if fine)."""
        for b in self.buckets[self._next :]:
            for j in range(len(b.params)):
                if j not in b.seen:
                    self._adopt(b, j)
            self._start(b)
        self._exchange = None
        return self.error

    def renew(self) -> None:
        """After a step that did not commit: fresh memory for every bucket. A collective that was
        abandoned (a member froze, the quorum broke) may still be inside Gloo holding the old
        buffers, and may yet complete, e.g. when the frozen member wakes, and write into them: so
        they are never used again (the abandoned work keeps them alive, not us)."""
        for b in self.buckets:
            b.flat = torch.zeros_like(b.flat)
            pos = 0
            for j, p in enumerate(b.params):
                b.views[j] = b.flat[pos : pos + p.numel()].view_as(p)
                pos += p.numel()
        for p in self.params:
            p.grad = None

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


# ---- one step's tensors, whichever way the gradients travel ----
def start_gradients(model: torch.nn.Module | None, buckets: GradientBuckets | None, ex: Any,
                    share: float) -> tuple[list[torch.nn.Parameter], torch.Tensor | None, str]:
    """Start what is left of the step's gradients on ``ex``: the tracked model's buckets not yet
    started, or (overlap off, or another model) one flat buffer, copied back on commit.
    Returns (parameters, the flat buffer or None, an error that makes the step unusable or "")."""
    if buckets is not None:
        if not buckets.armed:  # no shard before backward: start them all now
            buckets.arm(ex, share)
        error = buckets.finish()  # the caller filled the tail first, if the last bucket carries it
        return buckets.params, None, error
    params = [p for p in model.parameters() if p.requires_grad] if model is not None else []
    flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32)
    pos = 0
    for p in params:
        if p.grad is not None:
            torch.mul(p.grad.reshape(-1), share, out=flat[pos : pos + p.numel()])
        pos += p.numel()
    ex.launch(flat, 1.0)
    return params, flat, ""


def copy_back(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    pos = 0
    for p in params:
        reduced = flat[pos : pos + p.numel()].view_as(p).to(p.dtype)
        p.grad = reduced if p.grad is None else p.grad.copy_(reduced)
        pos += p.numel()


def coverage_tail(gbs: int, offset: int, idx: np.ndarray, loss: float, share: float, device: torch.device,
                  expected: np.ndarray | None, out: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, Callable[[], tuple[bool, float]]]:
    """The tail ``[coverage | loss * share]`` on the gradients' device (in ``out``, the last
    bucket's room for it, when given), and its check after the sum."""
    layout = TailLayout(gbs)
    tail = out if out is not None else torch.empty(layout.size, dtype=torch.float32, device=device)
    host = tail if tail.device.type == "cpu" else torch.empty(layout.size, dtype=tail.dtype)
    layout.fill(host.numpy(), offset, idx, loss, share)
    if host is not tail:
        tail.copy_(host)

    def verify() -> tuple[bool, float]:
        return layout.verify(tail.cpu().numpy() if tail.device.type != "cpu" else tail.numpy(), expected)

    return tail, verify
