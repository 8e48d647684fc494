"""A simulated worker: the production WorkerAgent and StepEngine with a small virtual-time body.

The life of a step (acquire, restore/heal/serve, vote, commit or roll back, checkpoints, the end
of the job, local-sgd merges) is the engine's (train/step_engine.py), exactly as on real workers.
What is simulated is only the body: compute takes virtual time from the observer's compute model,
and the arithmetic is real (a numpy linear regression), so parameters are real and checkable.
The worker sees the cluster through a frozen environment and an observer, never the Cluster.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import numpy as np

from phalanx.core.errors import CheckpointError, PhalanxError, TransportError
from phalanx.sim.host import SimHost
from phalanx.sim.network import SimNetwork
from phalanx.sim.process_group import SimProcessGroupFactory
from phalanx.sim.workload import RegressionData, SimModelConfig
from phalanx.train import sharding
from phalanx.train.step_buffer import TailLayout, expected_coverage
from phalanx.train.step_engine import BodyResult, StepEngine, Ticket
from phalanx.train.worker_agent import Assignment, HealedState, WorkerAgent, WorkerConfig


class SimCheckpoints:
    """Durable storage of a simulated run: survives every crash; paths are ``sim://checkpoint/S``."""

    def __init__(self) -> None:
        self._by_path: dict[str, tuple[int, np.ndarray]] = {}

    def write(self, step: int, w: np.ndarray) -> str:
        path = f"sim://checkpoint/{step}"
        self._by_path[path] = (step, w.copy())
        return path

    def read(self, path: str) -> tuple[int, np.ndarray]:
        if path not in self._by_path:
            raise CheckpointError(f"{path}: no such simulated checkpoint")
        step, w = self._by_path[path]
        return step, w.copy()


@dataclass(frozen=True)
class SimWorkerEnv:
    """What a simulated worker may use of its cluster."""

    net: SimNetwork
    pgf: SimProcessGroupFactory
    data: RegressionData
    model_cfg: SimModelConfig
    coordinator_address: str
    seed: int
    steps: int
    max_virtual_s: float
    checkpoints: SimCheckpoints = field(default_factory=SimCheckpoints)
    # each step's expected coverage, the same for every worker (read-only arrays; the newest few)
    coverage: dict[int, np.ndarray] = field(default_factory=dict)
    heal_load_s: float = 0.0  # Cluster.heal_load_s

    def expected_coverage(self, step: int) -> np.ndarray:
        cov = self.coverage.get(step)
        if cov is None:
            cfg = self.model_cfg
            cov = expected_coverage(step, cfg.dataset_size, cfg.global_batch_size, cfg.seed, np.float64)
            cov.flags.writeable = False
            if len(self.coverage) >= 16:
                self.coverage.pop(min(self.coverage))
            self.coverage[step] = cov
        return cov


class SimObserver(Protocol):
    """The cluster's side: compute model, trace, invariant checks."""

    def compute_s(self, w: "SimWorker", samples: int) -> float: ...

    # whether span() keeps anything (a large cluster's trace is off): a worker skips the call when not
    record_spans: bool | None

    def span(self, worker: str, name: str, start_s: float, **fields: Any) -> None: ...

    def on_worker_commit(self, w: "SimWorker", step: int, quorum_id: int, params: bytes) -> None: ...


class SimWorker:
    def __init__(self, env: SimWorkerEnv, observer: SimObserver, index: int) -> None:
        self.env, self.observer, self.index = env, observer, index
        self.worker_id = f"w{index}"
        self.node = env.net.add_node(self.worker_id)
        self.w = env.data.initial_params()
        self.agent: WorkerAgent | None = None
        self.engine: StepEngine | None = None
        self.task: asyncio.Task[Any] | None = None
        self.ended = ""
        self.hang_s = 0.0
        self.straggle_factor = 1.0
        self.restarts = 0
        self.gone = False  # killed with restart = false
        self._bucket_bounds: list[tuple[int, int]] | None = None
        self._layout = TailLayout(env.model_cfg.global_batch_size)  # the step's tail, the same every step

    # ---- lifecycle ----
    def start(self) -> None:
        env = self.env
        env.net.revive(self.node)
        self.w = env.data.initial_params()  # a fresh process has only its initial state
        host = SimHost(env.net, self.node, env.seed)
        cfg = WorkerConfig(worker_id=self.worker_id, coordinator_address=env.coordinator_address, heal_bind="heal",
                           connect_timeout_s=5.0, quorum_timeout_s=env.max_virtual_s, decision_timeout_s=30.0,
                           heal_timeout_s=10.0, reconnect_timeout_s=30.0, pid=10_000 + self.index)
        self.agent = WorkerAgent(host, cfg, lambda _addr, _run_id: env.pgf.for_node(self.node), self._capture)
        self.engine = StepEngine(self.agent, self, self, self)
        self.task = env.net.spawn(self.node, self._run(), "loop")

    def crash(self, process_exit_s: float | None = None) -> None:
        self.env.net.crash(self.node, process_exit_s)
        self.agent = None

    @property
    def completed(self) -> bool:
        return self.engine is not None and self.engine.completed

    @property
    def finished(self) -> bool:
        return self.task is not None and self.task.done() and self.node.alive

    async def _run(self) -> None:
        assert self.agent is not None and self.engine is not None
        try:
            await self.agent.start()
        except (TransportError, asyncio.TimeoutError, OSError) as e:
            self.ended = f"could not reach the coordinator: {e}"
            return
        try:
            await self.engine.run(self.env.steps)
            self.ended = self.engine.ended_reason
        except PhalanxError as e:  # FinalStateUnavailable, JobFailed: the job is over for this worker
            self.ended = str(e)

    # ---- StepObserver ----
    def span(self, name: str, start_s: float, **fields: Any) -> None:
        if self.observer.record_spans:
            self.observer.span(self.worker_id, name, start_s, **fields)

    def event(self, name: str, **fields: Any) -> None:
        assert self.agent is not None
        if self.observer.record_spans:
            self.observer.span(self.worker_id, name, self.agent.host.now(), **fields)

    # ---- StepBody ----
    async def run(self, ticket: Ticket) -> BodyResult:
        assert self.agent is not None and self.engine is not None
        host, a, cfg = self.agent.host, ticket.assignment, self.env.model_cfg
        gbs = cfg.global_batch_size
        offset, count = a.shard_bounds(gbs)  # even, or by measured speed in available mode
        idx = sharding.global_batch(ticket.step, cfg.dataset_size, gbs, cfg.seed)[offset : offset + count]
        t0 = host.now()
        compute_s = self.observer.compute_s(self, count)
        # the arithmetic, once: the parameters hold still through the body (sums over the shard / gbs)
        grad, loss = self.env.data.shard_gradient(self.w, idx)
        overlapped = cfg.overlap and not ticket.local and ticket.exchange is not None
        if overlapped:
            buf, buckets = await self._compute_overlapped(ticket, grad, compute_s, t0)
        else:
            await host.sleep(compute_s)
        if self.hang_s > 0:  # hung inside the step, heartbeats still flowing
            hang, self.hang_s = self.hang_s, 0.0
            await host.sleep(hang)
        share = count / gbs
        if ticket.local:  # local-sgd: a step on the shard's mean gradient, no vote
            self.w = self.w - cfg.lr * grad / share
            self.span("compute", t0, step=ticket.step, samples=count)
            return BodyResult(True, count, loss / share)
        ex = ticket.exchange
        assert ex is not None, "a voting ticket carries its exchange"
        # the gradient in buckets, in order (as real runs start them from autograd hooks); the last
        # carries the tail after its gradients, as in real runs: the same Exchange and vote
        if not overlapped:
            buf, buckets = self._step_buffer(grad)
            for b in buckets[:-1]:
                ex.launch(b, len(b) / cfg.features)
        layout, features = self._layout, cfg.features
        tail = buf[features:]
        layout.fill(tail, offset, idx, loss / share, share)
        expected = self.env.expected_coverage(a.step)
        self.span("compute", t0, step=a.step, quorum_id=a.quorum_id)
        t1 = host.now()
        ex.launch(buckets[-1], (len(buckets[-1]) - len(tail)) / features)
        vote = await self.engine.vote(a, ex, None, lambda: layout.verify(tail, expected), host.now() - t0)
        self.span("allreduce", t1, step=a.step, quorum_id=a.quorum_id, commit=vote.commit)
        if not vote.commit:
            return BodyResult(False, count, None, vote.reason)  # rolled back: parameters untouched
        self.w = self.w - cfg.lr * buf[:features]  # the summed gradient, in the step's buffer
        self.observer.on_worker_commit(self, a.step, a.quorum_id, self.w.tobytes())
        return BodyResult(True, count, vote.loss)

    def _step_buffer(self, grad: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """The step's one buffer, ``[gradient | tail]``, and its buckets: views in the configured
        number (np.array_split's bounds, computed once), the last running on through the tail, as
        a real run's last bucket carries the tail in its room."""
        if self._bucket_bounds is None:
            cfg = self.env.model_cfg
            n, k = cfg.features, max(1, min(cfg.grad_buckets, cfg.features))
            sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
            ends = list(itertools.accumulate(sizes))
            self._bucket_bounds = list(zip([0, *ends[:-1]], ends))
        features = len(grad)
        buf = np.empty(features + self._layout.size)
        buf[:features] = grad
        bounds = self._bucket_bounds
        return buf, [buf[a:b] for a, b in bounds[:-1]] + [buf[bounds[-1][0]:]]

    async def _compute_overlapped(self, ticket: Ticket, grad: np.ndarray, compute_s: float,
                                  t0: float) -> tuple[np.ndarray, list[np.ndarray]]:
        """Compute with overlap (SimModelConfig.overlap): bucket k of B is ready, and enters its
        all-reduce, at compute * (k+1)/B, in order, as a real backward's hooks start them. The
        gradient's arithmetic is the same as without overlap (the parameters do not change during
        the body), so only the timing differs; the group's links still carry one collective at
        a time (busy_until_s), so a bucket that is ready while the previous one is on the wire
        waits for it. The last bucket, ready as the compute ends, is started by the caller with the
        tail in it, as real runs do."""
        assert self.agent is not None and ticket.exchange is not None
        host, cfg = self.agent.host, self.env.model_cfg
        buf, buckets = self._step_buffer(grad)
        for k, b in enumerate(buckets):
            await host.sleep(max(0.0, t0 + compute_s * (k + 1) / len(buckets) - host.now()))
            if k < len(buckets) - 1:  # the last, ready as the compute ends, goes with the tail
                ticket.exchange.launch(b, len(b) / cfg.features)
        return buf, buckets

    # ---- TrainingState ----
    def _capture(self) -> tuple[bytes, list[memoryview], str]:
        assert self.agent is not None
        return msgspec.json.encode({"step": self.agent.last_committed_step}), [memoryview(self.w.tobytes())], ""

    async def restore_checkpoint(self, path: str) -> int:
        step, self.w = self.env.checkpoints.read(path)
        return step

    async def load_healed(self, healed: HealedState) -> None:
        self.w = np.frombuffer(bytes(healed.buffers[0]), dtype=np.float64).copy()
        if self.env.heal_load_s > 0 and self.agent is not None:  # a real worker decodes and copies its state
            await self.agent.host.sleep(self.env.heal_load_s)

    async def write_checkpoint(self, step: int, a: Assignment) -> str:
        return self.env.checkpoints.write(step, self.w)

    async def merge_buffer(self, weight: float, loss: float) -> tuple[Any, np.ndarray]:
        buf = np.concatenate([self.w * weight, [weight, loss * weight]])
        return buf, buf

    async def apply_merge(self, buffer: Any) -> None:
        self.w = buffer[: len(self.w)] / buffer[-2]
        assert self.agent is not None and self.engine is not None and self.engine.last is not None
        a = self.engine.last
        self.observer.on_worker_commit(self, a.step, a.quorum_id, self.w.tobytes())


def digest_lines(lines: list[str]) -> str:
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()
