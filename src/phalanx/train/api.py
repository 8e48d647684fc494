"""The synchronous user API: a thin facade over the asyncio WorkerAgent.

    job = phalanx.join()
    job.track(model=model, optimizer=optimizer)
    for step in job.steps(total_steps):
        idx = step.shard(dataset_size, global_batch_size)
        loss = loss_fn(model(x[idx]), y[idx])
        loss.backward()
        step.allreduce_gradients(model, loss=loss)
        optimizer.step(); optimizer.zero_grad()

The agent runs on its own event loop in a dedicated control thread (which is also the heartbeat
thread). A step whose quorum broke is *latched* as failed: the tracked optimizer's ``step()``
becomes a no-op, and when the loop body ends the same step number runs again on the new quorum.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from phalanx.core.auth import read_token_file
from phalanx.core.errors import (
    CheckpointError, CollectiveError, ConfigError, CoordinatorLost, FinalStateUnavailable, HealError, JobFailed, JobOver, PeerTimeout,
    QuorumBroken, StaleEpoch, StateCorrupt,
)
from phalanx.train import sharding
from phalanx.train.faults_in_process import InProcessFaults
from phalanx.train.worker_agent import Assignment, WorkerAgent, WorkerConfig

MAX_ATTEMPTS_PER_STEP = 100


class Step:
    """One attempt at one training step, on one quorum."""

    def __init__(self, job: "Job", a: Assignment) -> None:
        self._job, self._a = job, a
        self.started_s = time.monotonic()
        self._shard: tuple[int, int, np.ndarray, int, int] | None = None  # offset, count, idx, gbs, size
        self.loss: float | None = None
        self.committed = False
        self.failed = ""
        self._reduced = False
        self.local = False  # local-sgd: a local step, no all-reduce (merges happen between steps)

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


@dataclass
class _Counters:
    steps_committed: int = 0
    steps_retried: int = 0
    heals: int = 0


class Job:
    def __init__(self, agent: WorkerAgent, loop: asyncio.AbstractEventLoop, run_dir: Path, data_seed: int,
                 worker_id: str) -> None:
        self.agent, self._loop = agent, loop
        self.run_dir, self.data_seed, self.worker_id = run_dir, data_seed, worker_id
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.counters = _Counters()
        self.completed = False  # True once steps() ran to its end holding the final state
        self.ended_reason = ""
        self._current: Step | None = None
        self._last: Assignment | None = None
        self.max_world_size = 1  # the largest quorum this worker has been in
        self.faults = InProcessFaults(self)
        self._spans = _SpanLog(run_dir / "workers" / f"{worker_id}.jsonl", worker_id)

    # ---- properties users read ----
    @property
    def rank(self) -> int:
        return self._last.rank if self._last else 0

    @property
    def world_size(self) -> int:
        return self._last.world_size if self._last else 1

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def track(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Register the state that is healed to joining workers and checkpointed."""
        self.model, self.optimizer = model, optimizer
        if optimizer is not None:
            original = optimizer.step

            def guarded_step(*args: Any, **kwargs: Any) -> Any:
                cur = self._current
                if cur is not None and cur.failed:
                    return None  # the step is being rolled back: leave the optimizer untouched
                return original(*args, **kwargs)

            optimizer.step = guarded_step  # type: ignore[method-assign]
        self.agent.state_provider = self._encode_state

    # ---- the step loop ----
    @property
    def mode(self) -> str:
        """The run's consistency mode (core.modes): strict, available or local-sgd."""
        return self.agent.welcome.mode if self.agent.welcome else "strict"

    def steps(self, total: int) -> Iterator[Step]:
        if self.model is None:
            raise ConfigError("call job.track(model=..., optimizer=...) before job.steps()")
        if self.mode == "local-sgd":
            yield from self._steps_local_sgd(total)
            return
        step = self.agent.last_committed_step + 1
        try:
            while step < total:
                try:
                    a = self._acquire(step, total)
                except JobOver as e:
                    self._end_without_final(total - 1, str(e))
                step = a.step
                if step >= total or a.catch_up:
                    break  # a catch-up restored or healed the final state
                st = Step(self, a)
                self._current = st
                rng = torch.get_rng_state()
                yield st
                if not st._reduced and not st.failed:
                    self._allreduce(st, None, None)  # a body without gradients still votes
                if st.committed:
                    self._after_commit(st)
                    step += 1
                else:
                    self._rollback(st, rng)
        except GeneratorExit:
            self._call(self.agent.goodbye(False, "loop body raised or exited early"))
            raise
        self._finish(True, "finished")

    def _finish(self, completed: bool, reason: str) -> None:
        """The loop is over (both modes): say goodbye, holding the final state or not. A worker
        that holds it stays reachable for a bounded drain window, so a late peer can heal from it
        (the training thread waits here, so the state it serves is the final one)."""
        self._current = None
        self.completed, self.ended_reason = completed, reason
        self._call(self.agent.goodbye(completed, reason))
        if completed:
            self._call(self.agent.drain())

    def _end_without_final(self, final_step: int, why: str) -> None:
        """The job ended while this worker was behind and nothing could catch it up: never a
        normal end of ``job.steps()`` (the loop after it would save a stale model)."""
        held = self.agent.last_committed_step
        print(f"phalanx {self.worker_id}: {why}", file=sys.stderr, flush=True)
        self._finish(False, why)
        raise FinalStateUnavailable(self.worker_id, held, final_step, why)

    def _acquire(self, step: int, total: int = -1) -> Assignment:
        t0 = time.monotonic()
        for _ in range(MAX_ATTEMPTS_PER_STEP):
            try:
                a = self._call(self.agent.wait_for_quorum(step, total))
                try:
                    self._prepare(a)
                except (CheckpointError, OSError) as e:
                    if a.catch_up:  # the finished job's final checkpoint is all there was
                        raise JobOver(f"restoring the final checkpoint {a.restore_checkpoint} failed: {e}") from e
                    raise
                self._last = a
                self.max_world_size = max(self.max_world_size, a.world_size)
                self._spans.add("quorum_wait", t0, step=a.step, quorum_id=a.quorum_id)
                return a
            except (CoordinatorLost, QuorumBroken, HealError, StaleEpoch, StateCorrupt) as e:
                self._spans.event("acquire_retry", step=step, reason=str(e))
                if isinstance(e, CoordinatorLost):
                    self._call(self.agent.reconnect())
            except PeerTimeout as e:
                raise JobFailed(f"{self.worker_id}: {e}") from e
        raise JobFailed(f"{self.worker_id}: no usable quorum for step {step} after {MAX_ATTEMPTS_PER_STEP} attempts")

    def _prepare(self, a: Assignment) -> None:
        """Heal, restore or serve before the step body runs (state is stable while we wait)."""
        if a.restore_checkpoint:
            from phalanx.checkpoint.durable import read_checkpoint
            from phalanx.checkpoint.state_codec import restore_training_state

            t0 = time.monotonic()
            ck_step, state, _meta = read_checkpoint(a.restore_checkpoint)
            restore_training_state(self.model, self.optimizer, state)
            self.agent.last_committed_step, self.agent.has_state = ck_step, True
            self._spans.add("restore", t0, step=ck_step, path=a.restore_checkpoint)
        elif a.heal_from:
            from phalanx.checkpoint.state_codec import decode_training_state, restore_training_state

            t0 = time.monotonic()
            healed = self._call(self.agent.heal(a))
            state = decode_training_state(healed.header, healed.buffers)
            restore_training_state(self.model, self.optimizer, state)
            self._call(self.agent.heal_done(a, healed.checksum))
            self.counters.heals += 1
            self._spans.add("heal", t0, step=a.step, source=a.heal_from, quorum_id=a.quorum_id)
        if a.heal_targets:
            t0 = time.monotonic()
            self._call(self.agent.serve_heals(a))
            self._spans.add("heal_serve", t0, step=a.step, targets=list(a.heal_targets))

    def _encode_state(self) -> tuple[bytes, list[memoryview]]:
        from phalanx.checkpoint.state_codec import capture_training_state, encode_training_state

        assert self.model is not None
        state = capture_training_state(self.model, self.optimizer, {"step": self.agent.last_committed_step})
        return encode_training_state(state)

    def _allreduce(self, st: Step, model: torch.nn.Module | None, loss: Any) -> bool:
        self.faults.before_allreduce(st, time.monotonic() - st.started_s)
        compute_s = time.monotonic() - st.started_s  # a straggler's stretch counts: it is slow compute
        if st.local:
            # local-sgd: the local mean gradient stays as it is and the optimizer steps on it.
            st.committed = True
            st.loss = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss or 0.0)
            self._spans.add("compute", st.started_s, step=st.number, quorum_id=st.quorum_id)
            return True
        params = [p for p in model.parameters() if p.requires_grad] if model is not None else []
        sh = st._shard
        offset, count, idx, gbs = (sh[0], sh[1], sh[2], sh[3]) if sh else (0, 0, np.zeros(0, np.int64), 0)
        frac = count / gbs if gbs else 0.0
        loss_value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss or 0.0)
        parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) * frac for p in params]
        coverage = torch.zeros(gbs, dtype=torch.float32)
        coverage[offset : offset + count] = torch.from_numpy(idx.astype(np.float32) + 1.0)
        flat = torch.cat([*[t.float() for t in parts], coverage, torch.tensor([loss_value * frac])])
        expected = None
        if sh is not None:
            expected = torch.from_numpy(
                np.asarray(sharding.global_batch(st.number, sh[4], gbs, self.data_seed), dtype=np.float32) + 1.0)

        def verify(t: torch.Tensor) -> tuple[bool, float]:
            n = t.numel()
            cov = t[n - 1 - gbs : n - 1]
            ok = expected is not None and bool(torch.equal(cov, expected))
            return ok, float(t[-1])

        t0 = time.monotonic()
        self._spans.add("compute", st.started_s, step=st.number, quorum_id=st.quorum_id, samples=count)
        try:
            decision = self._call(self.agent.allreduce(st._a, flat, verify, compute_s))
        except (CoordinatorLost, PeerTimeout, CollectiveError) as e:
            return self._latch(st, params, f"no commit decision: {e}", t0)
        if not decision.commit:
            return self._latch(st, params, decision.reason, t0)
        pos = 0
        for p in params:
            n = p.numel()
            reduced = flat[pos : pos + n].view_as(p).to(p.dtype)
            if p.grad is None:
                p.grad = reduced.clone()
            else:
                p.grad.copy_(reduced)
            pos += n
        st.committed, st.loss = True, decision.loss
        self._spans.add("allreduce", t0, step=st.number, quorum_id=st.quorum_id, commit=True)
        return True

    def _latch(self, st: Step, params: list[torch.nn.Parameter], reason: str, t0: float) -> bool:
        st.failed = reason or "step aborted"
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        self._spans.add("allreduce", t0, step=st.number, quorum_id=st.quorum_id, commit=False, reason=st.failed)
        return False

    def _after_commit(self, st: Step) -> None:
        self.agent.committed(st.number)
        self.counters.steps_committed += 1
        self._spans.event("committed", step=st.number, quorum_id=st.quorum_id, loss=st.loss)
        if st._a.write_checkpoint:
            self._write_checkpoint(st._a, st.number)

    def _write_checkpoint(self, a: Assignment, step: int) -> None:
        from phalanx.checkpoint.durable import write_checkpoint
        from phalanx.checkpoint.state_codec import capture_training_state

        t0 = time.monotonic()
        state = capture_training_state(self.model, self.optimizer, {"step": step})
        path = write_checkpoint(self.run_dir, step, state, {"quorum_id": a.quorum_id, "members": list(a.members)})
        self._call(self.agent.checkpoint_written(step, str(path)))
        self._spans.add("checkpoint", t0, step=step)

    # ---- local-sgd: local steps, merges every H steps, bounded staleness ----
    def _steps_local_sgd(self, total: int) -> Iterator[Step]:
        """Local steps need no coordinator; a merge (a sync round, the coordinator's "step") every
        ``sync_every_steps``. A failed non-blocking merge is skipped; at ``max_staleness_steps``
        local steps past the last merge the worker blocks until it merges."""
        assert self.agent.welcome is not None
        every, bound = self.agent.welcome.sync_every_steps, self.agent.welcome.max_staleness_steps
        self._samples_since_merge = 0
        try:
            a = self._sync(0, must=True, total=total)  # round 0: everyone starts from the same state
            if a is None:
                return
            k = total if a.catch_up else max(0, a.local_step)
            merged_at = k
            while k < total:
                st = Step(self, dataclasses.replace(a, step=k, heal_from="", heal_targets=(),
                                                    restore_checkpoint="", write_checkpoint=False))
                st.local = True
                self._current = st
                yield st
                if not st._reduced:
                    self._allreduce(st, None, None)
                if st._shard is not None:
                    self._samples_since_merge += st._shard[1]
                k += 1
                self.counters.steps_committed += 1
                self._spans.event("local_step", step=k - 1, loss=st.loss, staleness=k - merged_at,
                                  samples=st._shard[1] if st._shard else 0)
                if k % every == 0 or k == total or k - merged_at >= bound:
                    got = self._sync(k, must=(k - merged_at >= bound or k == total), total=total)
                    if got is not None:
                        a = got
                        k = total if a.catch_up else max(k, a.local_step)
                        merged_at = k
        except JobOver as e:
            self._end_without_final(total, str(e))
        except GeneratorExit:
            self._call(self.agent.goodbye(False, "loop body raised or exited early"))
            raise
        self._finish(True, "finished")

    def _sync(self, k: int, must: bool, total: int) -> Assignment | None:
        """One merge at local step ``k``. Returns the assignment on commit (or on a catch-up to the
        finished job's final state); None if skipped."""
        assert self.agent.welcome is not None
        timeout_s = None if must else self.agent.welcome.sync_timeout_s
        t0 = time.monotonic()
        for _ in range(MAX_ATTEMPTS_PER_STEP):
            if not must and not self.agent.connected:
                self._spans.event("merge_skipped", step=k, reason="not connected to the coordinator")
                return None
            try:
                a = self._call(self.agent.wait_for_quorum(k, total, timeout_s))
                self._prepare(a)
                if a.catch_up:
                    return a
            except PeerTimeout as e:
                if must:
                    raise JobFailed(f"{self.worker_id}: {e}") from e
                self._spans.event("merge_skipped", step=k, reason=str(e))
                return None
            except (CoordinatorLost, QuorumBroken, HealError, StaleEpoch, StateCorrupt) as e:
                self._spans.event("acquire_retry", step=k, reason=str(e))
                if isinstance(e, CoordinatorLost):
                    if not must:
                        return None
                    self._call(self.agent.reconnect())
                continue
            self._last = a
            self.max_world_size = max(self.max_world_size, a.world_size)
            self._spans.add("quorum_wait", t0, step=k, quorum_id=a.quorum_id)
            if self._merge(a, k):
                return a
            if not must:
                return None
        raise JobFailed(f"{self.worker_id}: no merge at local step {k} after {MAX_ATTEMPTS_PER_STEP} attempts")

    def _merge(self, a: Assignment, k: int) -> bool:
        """The merge rule: parameters averaged with weights = samples trained since the member's last
        merge, plus one (so a member that trained nothing, e.g. just healed, counts a little and the
        first merge is a plain average of identical states). Optimizer state stays local."""
        assert self.model is not None
        params = list(self.model.parameters())
        weight = float(self._samples_since_merge + 1)
        last_loss = self._current.loss if self._current is not None and self._current.loss is not None else 0.0
        flat = torch.cat([*[p.detach().reshape(-1).float() * weight for p in params],
                          torch.tensor([weight, last_loss * weight])])

        def verify(t: torch.Tensor) -> tuple[bool, float]:
            return False, float(t[-1] / t[-2])  # no global batch to cover in a merge

        t0 = time.monotonic()
        try:
            decision = self._call(self.agent.allreduce(a, flat, verify, 0.0))
        except (CoordinatorLost, PeerTimeout, CollectiveError) as e:
            self._spans.add("allreduce", t0, step=k, quorum_id=a.quorum_id, commit=False, reason=str(e))
            return False
        if not decision.commit:
            self._spans.add("allreduce", t0, step=k, quorum_id=a.quorum_id, commit=False, reason=decision.reason)
            return False
        total_w = flat[-2]
        pos = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                p.copy_((flat[pos : pos + n] / total_w).view_as(p).to(p.dtype))
                pos += n
        self.agent.committed(a.step)
        self._samples_since_merge = 0
        self._spans.add("allreduce", t0, step=k, quorum_id=a.quorum_id, commit=True)
        self._spans.event("merged", round=a.step, step=k, quorum_id=a.quorum_id, members=list(a.members),
                          continue_at=max(k, a.local_step), loss=decision.loss)
        if a.write_checkpoint:
            self._write_checkpoint(a, a.step)
        return True

    def _rollback(self, st: Step, rng: torch.Tensor) -> None:
        self.counters.steps_retried += 1
        torch.set_rng_state(rng)
        if self.model is not None:
            for p in self.model.parameters():
                p.grad = None
        self._spans.event("rolled_back", step=st.number, quorum_id=st.quorum_id, reason=st.failed)

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


class _SpanLog:
    """Per-worker spans and events (JSON lines, monotonic clock shared by all local processes)."""

    def __init__(self, path: Path, worker_id: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", buffering=1)
        self._wid = worker_id

    def add(self, span: str, start_s: float, **fields: Any) -> None:
        now = time.monotonic()
        self._write({"mono": round(start_s, 6), "dur": round(now - start_s, 6), "node": self._wid, "span": span, **fields})

    def event(self, event: str, **fields: Any) -> None:
        self._write({"mono": round(time.monotonic(), 6), "node": self._wid, "event": event, **fields})

    def _write(self, record: dict[str, Any]) -> None:
        try:
            self._f.write(json.dumps(record) + "\n")
        except ValueError:
            pass  # closed at exit

    def close(self) -> None:
        self._f.close()


def join(**overrides: Any) -> Job:
    """Join the cluster this process was started into by ``phalanx launch`` (reads PHALANX_* env)."""
    env = {**os.environ, **{k.upper(): str(v) for k, v in overrides.items()}}
    try:
        coordinator = env["PHALANX_COORDINATOR"]
        token = read_token_file(env["PHALANX_TOKEN_FILE"])
        worker_id = env["PHALANX_WORKER_ID"]
    except KeyError as e:
        raise ConfigError(f"{e.args[0]} is not set: start this script with `phalanx launch -- python SCRIPT`") from e
    run_dir = Path(env.get("PHALANX_RUN_DIR", "runs/latest"))
    data_seed = int(env.get("PHALANX_DATA_SEED", "0"))
    import random

    from phalanx.collectives.process_group import TorchProcessGroupFactory
    from phalanx.train.network_faults import NetworkFaults
    from phalanx.transport.real_host import RealHost
    from phalanx.transport.tcp import TcpTransport

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="phalanx-control", daemon=True)
    thread.start()
    transport = TcpTransport(token, name=worker_id)
    host = RealHost(worker_id, transport)
    # network faults act at the seams: host.transport becomes a FaultyTransport, groups are wrapped
    net = NetworkFaults.install(host, coordinator, random.Random(f"net:{data_seed}:{worker_id}"))
    cfg = WorkerConfig(worker_id=worker_id, coordinator_address=coordinator,
                       heal_bind=env.get("PHALANX_HEAL_BIND", "127.0.0.1:0"))
    agent = WorkerAgent(host, cfg, lambda addr: net.wrap(TorchProcessGroupFactory(addr, token)))
    job = Job(agent, loop, run_dir, data_seed, worker_id)
    net.log = job._spans.event
    agent._on_fault = net.route(job.faults.on_fault)  # called on the control thread
    job.faults.install()
    asyncio.run_coroutine_threadsafe(agent.start(), loop).result(
        timeout=cfg.reconnect_timeout_s + 2 * cfg.connect_timeout_s)
    return job
