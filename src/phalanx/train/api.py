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
import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from phalanx.core.errors import ConfigError, FinalStateUnavailable
from phalanx.train import host_memory, sharding
from phalanx.train.exchange import Exchange
from phalanx.train.faults_in_process import InProcessFaults
from phalanx.train.grad_buckets import DEFAULT_BUCKET_BYTES, GradientBuckets, copy_back, coverage_tail, start_gradients
from phalanx.train.speculation import (DEFAULT_MAX_BYTES, Pending, StateSnapshot, same_body, setting_from_env,
                                       settle_once)
from phalanx.train.step_buffer import TailLayout, expected_coverage
from phalanx.train.step_engine import BodyResult, StepEngine, Ticket, Vote
from phalanx.train.thread_body import ThreadBody
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
        self._guess: Pending | None = None  # run on a guessed grant while this verdict travels
        self._orphan = False  # a guess that turned out wrong: the engine never handed this body
        self._rng_back: torch.Tensor | None = None  # where the random state goes back to, if not its own start

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
        With ``PHALANX_SPECULATE=on`` and a small tracked model the True may come before the
        verdict (train/speculation.py): if that verdict is an abort, the model and optimizer go
        back and the next step's call returns False.
        """
        assert not self._reduced, "allreduce_gradients is called once per step"
        self._reduced = True
        return self._job._allreduce(self, model, loss)


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
        self._snapshot: StateSnapshot | None = None  # PHALANX_SPECULATE=on, small models: speculate
        self._pending: Pending | None = None  # the step whose verdict travels while a guess runs
        self.faults = InProcessFaults(self)
        self._spans = SpanLog(run_dir / "workers" / f"{worker_id}.jsonl", worker_id)
        self._spans.batch_on(loop)
        self._body = ThreadBody(loop)
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
        self._spans.event("host_memory", detail=host_memory.tune_for_parameters(model.parameters()),
                          huge_pages=host_memory.heap_on_huge_pages())
        if overlap and self.mode != "local-sgd":
            self._buckets = GradientBuckets(list(model.parameters()), bucket_bytes)
        self._snapshot = None
        if setting_from_env() == "on" and self._buckets is not None and optimizer is not None \
                and StateSnapshot.fits(model, optimizer, DEFAULT_MAX_BYTES):
            self._snapshot = StateSnapshot(model, optimizer, DEFAULT_MAX_BYTES)
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
                st._guess, self._current = self._pending, st  # a guess runs while the last verdict travels
                rng = torch.get_rng_state()
                yield st
                if not st._reduced and not st.failed:
                    # a body without gradients still votes (the tracked model's buckets, if any, so
                    # every rank starts the same collectives)
                    self._allreduce(st, self.model if self._buckets is not None else None, None)
                self._settle(st, block=True)
                if not st.committed:
                    self._rollback(st._rng_back if st._rng_back is not None else rng)
                p = self._pending
                if p is not None and p.step is st:  # its verdict travels: the next body runs on a guess
                    p.rng, ticket = rng, p.guess()
                    continue
                if st._orphan:  # the engine never handed it: run what it did hand, or wait for it
                    ticket, self._next = self._next or self._body.next_ticket(), None
                    continue
                if self._next is None:  # else the vote that handed it gave the engine this result
                    samples = st._shard[1] if st._shard else 0
                    self._body.body_done(BodyResult(st.committed, samples, st.loss, st.failed))
                ticket, self._next = (self._next, None) if self._next is not None else (self._body.next_ticket(), None)
        except GeneratorExit:
            p, self._pending = self._pending, None
            if p is not None and self._snapshot is not None and not p.vote.result().commit:
                self._snapshot.restore()  # the model is left as the last committed step made it
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
        self._settle(st, block=False)  # a guess whose verdict is in already: its buckets may start early
        b, ex, sh = self._buckets, st._ex, st._shard
        if b is not None and ex is not None and sh is not None and not st.local and sh[3]:
            b.arm(ex, sh[1] / sh[3], TailLayout(sh[3]).size)

    def _wait_here(self, st: Step, ex: Exchange) -> None:
        """Wait for the step's collectives on this thread (the GIL released) before the vote goes to
        the loop (``Exchange.wait_here``): the control thread is then woken once a step, with the
        sum complete. A broken quorum or a lost coordinator wakes the wait at once (the control
        loop, ``WorkerAgent.entering_allreduce``); the vote then says what happened, as before."""
        agent, qid = self.agent, st.quorum_id
        agent.entering_allreduce(st.number, qid, ex)
        ex.wait_here(lambda: agent.quorum_gone(qid), agent.collective_timeout_s, time.monotonic)

    def _allreduce(self, st: Step, model: torch.nn.Module | None, loss: Any) -> bool:
        """The vote: the gradient buckets ``* n_i/N`` (most already on the wire, started during
        backward), then the tail ``[coverage | loss * n_i/N]`` (train/step_buffer.py); summed
        over the quorum. On commit the ``.grad`` tensors already hold the reduced gradients."""
        self._settle(st, block=True)
        if st.failed:  # a guess that was wrong: nothing of it went on the wire
            self._rollback(None)
            return False
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
        if self._snapshot is not None and buckets is not None and self.engine.asks_next(st._a) >= 0:
            vote, loss_now = self._vote_speculating(st, ex, verify, compute_s, count)
            if vote is None:  # complete and covered: go on; the verdict is settled in the next step
                st.committed, st.loss = True, loss_now
                self._spans.span("allreduce", t0, step=st.number, quorum_id=st.quorum_id, commit=True,
                                 speculative=True)
                return True
        else:
            self._wait_here(st, ex)
            vote = self._body.send_vote(self.engine.vote(st._a, ex, None, verify, compute_s), count).result()
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

    def _vote_speculating(self, st: Step, ex: Any, verify: Any, compute_s: float,
                          count: int) -> tuple[Vote | None, float | None]:
        """The vote, handed to the loop; returns (None, global loss) as soon as the all-reduce has
        completed with the batch covered exactly once and the state is snapshotted (the verdict
        stays pending in ``self._pending``), else (the verdict, None) once it is in."""
        early: concurrent.futures.Future[float | None] = concurrent.futures.Future()

        def checked() -> tuple[bool, float]:  # on the loop, after the collectives, before the report
            covered, loss = verify()
            if covered:
                settle_once(early, loss)
            return covered, loss

        vf = self._body.send_vote(self.engine.vote(st._a, ex, None, checked, compute_s), count)
        vf.add_done_callback(lambda _f: settle_once(early, None))
        loss = early.result()
        assert self._snapshot is not None, "only a job with a snapshot speculates"
        if loss is None or not self._snapshot.take():
            return vf.result(), None
        self._pending = Pending(st, vf, count)
        return None, loss

    def _settle(self, st: Step, block: bool) -> None:
        """Settle the verdict ``st``'s guess was waiting on (not blocking: only if it is in)."""
        p = st._guess
        if p is None or (not block and not p.vote.done()):
            return
        st._guess = self._pending = None
        v, prev = p.vote.result(), p.step
        if v.commit and v.next is not None and same_body(v.next.assignment, st._a):
            st._a, st._ex = v.next.assignment, v.next.exchange  # the guess was the grant
            return
        st._orphan = True
        if v.commit:
            st.failed = "the next step was granted differently than guessed: its body runs again"
            if v.next is not None:
                self._next = v.next  # handed, with the committed step's result, to run next
            else:
                self._body.body_done(BodyResult(True, p.samples, v.loss, ""))
        else:
            assert self._snapshot is not None
            self._snapshot.restore()
            prev.committed, prev.failed = False, v.reason or "step aborted"
            st.failed = f"step {prev.number} was aborted after all ({prev.failed}): it runs again"
            st._rng_back = p.rng
            if self._buckets is not None:
                self._buckets.renew()
            self._body.body_done(BodyResult(False, 0, None, prev.failed))
        self._spans.event("speculation_undone", step=prev.number, reason=st.failed)

    def _rollback(self, rng: torch.Tensor | None) -> None:
        if rng is not None:
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
