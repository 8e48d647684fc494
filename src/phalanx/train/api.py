"""The synchronous user API: ``Job`` bridges the user's loop to the step engine.

    job = phalanx.join()
    job.track(model=model, optimizer=optimizer)
    for step in job.steps(total_steps):
        idx = step.shard(dataset_size, global_batch_size)
        loss = loss_fn(model(x[idx]), y[idx])
        loss.backward()
        step.allreduce_gradients(model, loss=loss)
        optimizer.step(); optimizer.zero_grad()
    job.save_final()

The step engine (train/step_engine.py) and the WorkerAgent run on an asyncio loop in a dedicated
control thread (which is also the heartbeat thread); each step's body runs on the user's thread.
A step whose quorum broke is *latched* as failed: the tracked optimizer's ``step()`` becomes a
no-op, and when the loop body ends the engine runs the same step number again on the new quorum.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from phalanx.core.errors import ConfigError, FinalStateUnavailable
from phalanx.train import host_memory, sharding
from phalanx.train.faults_in_process import InProcessFaults
from phalanx.train.grad_buckets import DEFAULT_BUCKET_BYTES, GradientBuckets, copy_back, coverage_tail, start_gradients
from phalanx.train.step_buffer import TailLayout, expected_coverage
from phalanx.train.step_engine import BodyResult, LoopExited, StepEngine, Ticket, Vote
from phalanx.train.torch_state import SpanLog, TorchState
from phalanx.train.worker_agent import WorkerAgent


class Step:
    """One attempt at one training step, on one quorum."""

    def __init__(self, job: "Job", ticket: Ticket) -> None:
        self._job, self._a = job, ticket.assignment
        self.local = ticket.local  # local-sgd: a local step, no all-reduce (merges happen between steps)
        self._ex = ticket.exchange
        self.started_s = time.monotonic()
        self._shard: tuple[int, int, np.ndarray, int, int] | None = None  # offset, count, idx, gbs, size
        self.loss: float | None = None
        self.committed = False
        self.failed = ""
        self._reduced = False

    number = property(lambda self: self._a.step, doc="the step number (same on every retry)")
    quorum_id = property(lambda self: self._a.quorum_id, doc="the epoch this attempt runs in")
    members = property(lambda self: list(self._a.members), doc="worker ids in this step's quorum")
    rank = property(lambda self: self._a.rank)
    world_size = property(lambda self: self._a.world_size)

    def shard(self, dataset_size: int, global_batch_size: int) -> np.ndarray:
        """This worker's sample indices of this step's fixed global batch."""
        offset, count = self._a.shard_bounds(global_batch_size)
        gb = sharding.global_batch(self.number, dataset_size, global_batch_size, self._job.data_seed)
        idx = np.array(gb[offset : offset + count])
        self._shard = (offset, count, idx, global_batch_size, dataset_size)
        self._job._arm(self)
        return idx

    @property
    def relative_share(self) -> float:
        """This shard's size relative to an even split over the largest quorum seen (1.0 with every
        worker in; more when members are missing; less for a slow member in available mode)."""
        if self._shard is None or self._shard[3] == 0:
            return 1.0
        return self._shard[1] * max(self.world_size, self._job.max_world_size) / self._shard[3]

    def allreduce_gradients(self, model: torch.nn.Module | None, loss: torch.Tensor | float | None = None) -> bool:
        """Average gradients over the whole global batch across the quorum. Returns True on commit.

        On a broken quorum the gradients are zeroed, the step is latched as failed (the tracked
        optimizer will not step) and the loop body will run again. Never raises for faults.
        """
        assert not self._reduced, "allreduce_gradients is called once per step"
        self._reduced = True
        return self._job._allreduce(self, model, loss)


class _ThreadBody:
    """The StepBody of real runs: hands each ticket to the user's thread (the body of their
    ``for step in job.steps(...)`` loop) and waits until that body has ended. A ticket the engine
    already handed over with the last vote (the fast path) is not queued again; results come back
    in order, so one that arrives before the engine waits for it is kept."""

    _END = object()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._tickets: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._results: asyncio.Queue[BodyResult | Exception] | None = None

    async def run(self, ticket: Ticket) -> BodyResult:
        if self._results is None:
            self._results = asyncio.Queue()
        if not ticket.handed:
            self._tickets.put(ticket)
        item = await self._results.get()
        if isinstance(item, Exception):
            raise item
        return item

    # ---- called on the user's thread ----
    def next_ticket(self) -> Ticket | None:
        """The next step to run, or None once the engine has ended (its result says how)."""
        item = self._tickets.get()
        return None if item is self._END else item

    def body_done(self, result: BodyResult) -> None:
        self._loop.call_soon_threadsafe(self._put, result)

    def body_exited(self, why: str) -> None:
        self._loop.call_soon_threadsafe(self._put, LoopExited(why))

    def ended(self, _fut: Any = None) -> None:
        self._tickets.put(self._END)

    async def vote(self, voting: Coroutine[Any, Any, Vote], samples: int) -> Vote:
        """The vote, on the loop. A commit that hands the next ticket is this body's result as well
        (nothing after it can un-commit the step: a failing user loop ends the job either way), so
        the engine gets it here, without another hop from the user's thread."""
        vote = await voting
        if vote.commit and vote.next is not None:
            self._put(BodyResult(True, samples, vote.loss, ""))
        return vote

    def _put(self, item: BodyResult | Exception) -> None:
        if self._results is None:
            self._results = asyncio.Queue()
        self._results.put_nowait(item)


class Job:
    """The user's handle: ``job.track(...)``, ``for step in job.steps(n)``, ``job.save_final()``.

    A bridge: the step engine (:mod:`phalanx.train.step_engine`) runs on the control thread and
    hands each step to the user's thread; ``step.allreduce_gradients`` is the engine's vote.
    """

    def __init__(self, agent: WorkerAgent, loop: asyncio.AbstractEventLoop, run_dir: Path, data_seed: int,
                 worker_id: str) -> None:
        self.agent, self._loop = agent, loop
        self.run_dir, self.data_seed, self.worker_id = run_dir, data_seed, worker_id
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._current: Step | None = None
        self._buckets: GradientBuckets | None = None
        self._next: Ticket | None = None  # handed over with the last vote (the fast path)
        self.faults = InProcessFaults(self)
        self._spans = SpanLog(run_dir / "workers" / f"{worker_id}.jsonl", worker_id)
        self._body = _ThreadBody(loop)
        self.engine = StepEngine(agent, self._body, TorchState(self), self._spans)

    # ---- properties users read ----
    counters = property(lambda self: self.engine.counters)
    completed = property(lambda self: self.engine.completed, doc="steps() ran to its end holding the final state")
    ended_reason = property(lambda self: self.engine.ended_reason)
    max_world_size = property(lambda self: self.engine.max_world_size, doc="the largest quorum this worker was in")

    @property
    def rank(self) -> int:
        return self.engine.last.rank if self.engine.last else 0

    @property
    def world_size(self) -> int:
        return self.engine.last.world_size if self.engine.last else 1

    @property
    def mode(self) -> str:
        """The run's consistency mode (core.modes): strict, available or local-sgd."""
        return self.engine.mode

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def track(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
              overlap: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        """Register the state that is healed to joining workers and checkpointed.

        With ``overlap`` (the default) the model's gradients are all-reduced in buckets of at most
        ``bucket_bytes`` during ``loss.backward()``, from autograd hooks (train/grad_buckets.py):
        one backward per step. ``overlap=False`` all-reduces them in ``allreduce_gradients``
        instead (for gradient accumulation over several backward passes)."""
        if self._buckets is not None:
            self._buckets.close()
            self._buckets = None
        self.model, self.optimizer = model, optimizer
        # the optimizer's temporaries come from malloc each step (train/host_memory.py)
        self._spans.event("host_memory", detail=host_memory.tune_for_parameters(model.parameters()))
        if overlap and self.mode != "local-sgd":
            self._buckets = GradientBuckets(list(model.parameters()), bucket_bytes)
        if optimizer is not None:
            original = optimizer.step

            def guarded_step(*args: Any, **kwargs: Any) -> Any:
                cur = self._current
                if cur is not None and cur.failed:
                    return None  # the step is being rolled back: leave the optimizer untouched
                return original(*args, **kwargs)

            optimizer.step = guarded_step  # type: ignore[method-assign]
        self.agent.state_provider = self._encode_state

    # ---- the step loop: tickets from the engine, run on this (the user's) thread ----
    def steps(self, total: int) -> Iterator[Step]:
        """Yield each step to run; ends normally only holding the job's final state (else raises
        FinalStateUnavailable or JobFailed)."""
        if self.model is None:
            raise ConfigError("call job.track(model=..., optimizer=...) before job.steps()")
        engine = asyncio.run_coroutine_threadsafe(self.engine.run(total), self._loop)
        engine.add_done_callback(self._body.ended)
        try:
            ticket = self._body.next_ticket()
            while ticket is not None:
                st = Step(self, ticket)
                self._current = st
                rng = torch.get_rng_state()
                yield st
                if not st._reduced and not st.failed:
                    # a body without gradients still votes (the tracked model's buckets, if any, so
                    # every rank starts the same collectives)
                    self._allreduce(st, self.model if self._buckets is not None else None, None)
                if not st.committed:
                    self._rollback(rng)
                if self._next is None:  # else the vote that handed it gave the engine this result
                    samples = st._shard[1] if st._shard else 0
                    self._body.body_done(BodyResult(st.committed, samples, st.loss, st.failed))
                ticket, self._next = (self._next, None) if self._next is not None else (self._body.next_ticket(), None)
        except GeneratorExit:
            self._body.body_exited("loop body raised or exited early")
            engine.result()
            raise
        finally:
            self._current = None
            if self._buckets is not None:
                self._buckets.disarm()
        engine.result()  # re-raises how the engine ended: FinalStateUnavailable, JobFailed, ...

    def _encode_state(self) -> tuple[bytes, list[memoryview], str]:
        from phalanx.checkpoint.state_codec import capture_training_state, encode_training_state, header_checksum

        assert self.model is not None
        state = capture_training_state(self.model, self.optimizer, {"step": self.agent.last_committed_step})
        header, buffers = encode_training_state(state)
        return header, buffers, header_checksum(header)

    def _arm(self, st: Step) -> None:
        """The step's shard is known: from here, completed gradient buckets start their all-reduce
        from the backward pass (the quorum's group is already open in the ticket's exchange)."""
        b, ex, sh = self._buckets, st._ex, st._shard
        if b is not None and ex is not None and sh is not None and not st.local and sh[3]:
            b.arm(ex, sh[1] / sh[3], TailLayout(sh[3]).size)

    def _allreduce(self, st: Step, model: torch.nn.Module | None, loss: Any) -> bool:
        """The vote: the gradient buckets ``* n_i/N`` (most already on the wire, started during
        backward), then the tail ``[coverage | loss * n_i/N]`` (train/step_buffer.py); summed
        over the quorum. On commit the ``.grad`` tensors already hold the reduced gradients."""
        self.faults.before_allreduce(st, time.monotonic() - st.started_s)
        compute_s = time.monotonic() - st.started_s  # a straggler's stretch counts: it is slow compute
        loss_value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss or 0.0)
        if st.local:  # local-sgd: the local mean gradient stays as it is and the optimizer steps on it
            st.committed, st.loss = True, loss_value
            self._spans.span("compute", st.started_s, step=st.number, quorum_id=st.quorum_id)
            return True
        ex = st._ex
        assert ex is not None, "a voting step carries its exchange"
        sh = st._shard
        offset, count, idx, gbs = (sh[0], sh[1], sh[2], sh[3]) if sh else (0, 0, np.zeros(0, np.int64), 0)
        share = count / gbs if gbs else 0.0
        buckets = self._buckets if model is self.model else None
        if buckets is not None and not buckets.armed:  # no shard before backward: armed now
            buckets.arm(ex, share, TailLayout(gbs).size)
        # the tail rides in the last bucket when it can (filled before that bucket starts), else alone
        carrier = buckets.tail_view() if buckets is not None else None
        error = buckets.error if buckets is not None else ""  # known from the hooks: withhold the coverage
        tail, verify = coverage_tail(gbs, offset, idx if not error else np.zeros(0, np.int64), loss_value, share,
                                     buckets.device if buckets is not None else torch.device("cpu"),
                                     expected_coverage(st.number, sh[4], gbs, self.data_seed) if sh else None,
                                     out=carrier)
        params, flat, error = start_gradients(model, buckets, ex, share)
        self._spans.span("compute", st.started_s, step=st.number, quorum_id=st.quorum_id, samples=count)
        t0 = time.monotonic()
        if carrier is None:
            ex.launch(tail, 0.0)  # from this thread too: the tail need not wait for the hand-over
        vote = self._call(self._body.vote(self.engine.vote(st._a, ex, None, verify, compute_s), count))
        if error:  # the coverage was withheld, so the step aborted everywhere; now say why
            if buckets is not None:
                buckets.renew()
            raise ConfigError(error)
        if not vote.commit:
            st.failed = vote.reason or "step aborted"
            if buckets is not None:
                buckets.renew()  # an abandoned collective may still write into the old buffers
            for p in params:
                p.grad = None
            self._spans.span("allreduce", t0, step=st.number, quorum_id=st.quorum_id, commit=False, reason=st.failed)
            return False
        self._next = vote.next  # the next step, granted and ready (the engine has this step's result)
        if flat is not None:
            copy_back(params, flat)
        st.committed, st.loss = True, vote.loss
        self._spans.span("allreduce", t0, step=st.number, quorum_id=st.quorum_id, commit=True)
        return True

    def _rollback(self, rng: torch.Tensor) -> None:
        torch.set_rng_state(rng)
        if self.model is not None:
            for p in self.model.parameters():
                p.grad = None

    def save_final(self, name: str = "") -> Path:
        """Write the final model's parameters (raw safetensors) to ``RUN/<name>.safetensors``
        (default ``final_<worker id>``) and return the path.

        Raises FinalStateUnavailable when this worker does not hold the job's final state (its
        ``job.steps()`` did not run to its end), so a stale model is never saved as the final one.
        """
        from phalanx.checkpoint.durable import write_tensors_file

        if self.model is None:
            raise ConfigError("call job.track(model=...) before job.save_final()")
        if not self.completed:
            raise FinalStateUnavailable(self.worker_id, self.agent.last_committed_step, -1,
                                        self.ended_reason or "job.steps() has not run to its end")
        path = self.run_dir / f"{name or 'final_' + self.worker_id}.safetensors"
        write_tensors_file(path, {k: v.detach() for k, v in self.model.state_dict().items()})
        return path

    def close(self) -> None:
        self._spans.close()
