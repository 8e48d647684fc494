"""The torch side of a real worker's seams: the TrainingState (the tracked model and optimizer)
and the StepObserver (the worker's JSONL span log)."""

from __future__ import annotations

import asyncio
import atexit
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from phalanx.core.jsonl_batch import JsonLinesBatch
from phalanx.train.step_buffer import MergeLayout
from phalanx.train.worker_agent import Assignment, HealedState


class TorchState:
    """The TrainingState seam on torch: the tracked model and optimizer. Runs while the user's
    thread is idle (blocked between bodies), in a worker thread so heartbeats keep flowing."""

    def __init__(self, job: Any) -> None:
        self._job = job

    async def restore_checkpoint(self, path: str) -> int:
        from phalanx.checkpoint.durable import read_checkpoint
        from phalanx.checkpoint.state_codec import restore_training_state

        def load() -> int:
            ck_step, state, _meta = read_checkpoint(path)
            restore_training_state(self._job.model, self._job.optimizer, state)
            return ck_step

        return await asyncio.to_thread(load)

    async def load_healed(self, healed: HealedState) -> None:
        from phalanx.checkpoint.state_codec import decode_training_state, restore_training_state

        def load() -> None:
            state = decode_training_state(healed.header, healed.buffers, verified_sha256=healed.checksum)
            restore_training_state(self._job.model, self._job.optimizer, state)

        await asyncio.to_thread(load)

    async def write_checkpoint(self, step: int, a: Assignment) -> str:
        from phalanx.checkpoint.durable import write_checkpoint
        from phalanx.checkpoint.state_codec import capture_training_state

        def write() -> str:
            state = capture_training_state(self._job.model, self._job.optimizer, {"step": step})
            return str(write_checkpoint(self._job.run_dir, step, state,
                                        {"quorum_id": a.quorum_id, "members": list(a.members)}))

        return await asyncio.to_thread(write)

    async def merge_buffer(self, weight: float, loss: float) -> tuple[Any, np.ndarray]:
        assert self._job.model is not None
        params = list(self._job.model.parameters())
        flat = torch.empty(MergeLayout(sum(p.numel() for p in params)).size, dtype=torch.float32)
        pos = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                flat[pos : pos + n].copy_(p.detach().reshape(-1)).mul_(weight)
                pos += n
        view = flat.numpy()
        MergeLayout.fill_tail(view, weight, loss)
        return flat, view

    async def apply_merge(self, buffer: Any) -> None:
        assert self._job.model is not None
        total_w = MergeLayout.total_weight(buffer.numpy())
        pos = 0
        with torch.no_grad():
            for p in self._job.model.parameters():
                n = p.numel()
                p.copy_((buffer[pos : pos + n] / total_w).view_as(p).to(p.dtype))
                pos += n


FLUSH_S = 0.25  # the control thread's lines wait at most this long in memory (see SpanLog)
BATCH_MAX = 256  # ... or until this many are waiting


class SpanLog:
    """Per-worker spans and events (JSON lines, monotonic clock shared by all local processes).

    Spans, and the control thread's events, wait in memory as records and are encoded and written
    together from a timer on the control loop, at most ``FLUSH_S`` after the control thread's
    first line of the batch (it records every step; also once ``BATCH_MAX`` wait, and at
    ``close`` or exit). Encoded and written one by one, each step's ``committed`` and
    ``quorum_wait`` held the GIL 60-80 us while the user's thread was waking up from its verdict,
    and its ``allreduce`` span delayed the optimizer (docs/BENCHMARKS.md, session 32). Any other
    thread's events (a fault's, an undone speculation's) go out at once. The file's lines are then not in time
    order across threads; every record carries its own ``mono``. A SIGKILLed worker loses what was
    still waiting: at most its last ``FLUSH_S`` of spans and control-thread events.

    A ``gil_hang`` fault's events are written from a signal handler on the training thread
    (train/faults_in_process.py), which may interrupt that thread inside a write to this very
    file: the file refuses the reentrant call (RuntimeError), so such a line waits and goes out
    before the next one. Its timestamp was taken when it happened."""

    def __init__(self, path: Path, worker_id: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", buffering=1)
        self._wid = worker_id
        self._deferred: list[str] = []
        self._batch = JsonLinesBatch(self._put, FLUSH_S, BATCH_MAX)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = -1
        atexit.register(self.flush)  # a script that never calls job.close() still gets every line

    def batch_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """From here, lines written on ``loop``'s thread wait for a batch (see the class). Thread-safe."""
        def here() -> None:
            self._loop, self._loop_thread = loop, threading.get_ident()
        loop.call_soon_threadsafe(here)

    def span(self, span: str, start_s: float, **fields: Any) -> None:
        now = time.monotonic()
        self._write({"mono": round(start_s, 6), "dur": round(now - start_s, 6), "node": self._wid, "span": span,
                     **fields}, True)

    def event(self, event: str, **fields: Any) -> None:
        self._write({"mono": round(time.monotonic(), 6), "node": self._wid, "event": event, **fields}, False)

    def _write(self, record: dict[str, Any], is_span: bool) -> None:
        loop = self._loop
        on_loop = loop is not None and threading.get_ident() == self._loop_thread
        if loop is None or not (on_loop or is_span):
            self._put(json.dumps(record) + "\n")
        else:  # the control thread sets the timer; it records something every step
            self._batch.add(record, loop if on_loop else None)

    def flush(self) -> None:
        """Write the waiting batch (on the control thread's timer, or at close)."""
        self._batch.flush()

    def _put(self, line: str) -> None:
        if self._deferred:
            pending, self._deferred = self._deferred, []
            line = "".join(pending) + line
        try:
            self._f.write(line)
        except ValueError:
            pass  # closed at exit
        except RuntimeError:  # reentrant: a signal handler's write inside a write on this thread
            self._deferred.append(line)

    def close(self) -> None:
        self._loop = None  # from here every line goes out at once
        self.flush()
        self._f.close()
