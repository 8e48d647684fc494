"""A simulated worker: the production WorkerAgent driven by an async step loop.

The loop mirrors the real facade (train/api.py): ask for a quorum, restore/heal/serve, compute,
all-reduce gradients plus the coverage vector and loss, then commit or roll back. Compute takes
virtual time from the cluster's compute model; the arithmetic is real (numpy regression).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from phalanx.core.errors import (
    CollectiveError, CoordinatorLost, HealError, JobOver, PeerTimeout, QuorumBroken, StaleEpoch, StateCorrupt,
    TransportError,
)
from phalanx.sim.host import SimHost
from phalanx.sim.workload import params_digest
from phalanx.train import sharding
from phalanx.train.worker_agent import Assignment, WorkerAgent, WorkerConfig

if TYPE_CHECKING:
    from phalanx.sim.cluster import Cluster

MAX_ATTEMPTS = 200


class SimWorker:
    def __init__(self, cluster: "Cluster", index: int) -> None:
        self.cluster, self.index = cluster, index
        self.worker_id = f"w{index}"
        self.node = cluster.net.add_node(self.worker_id)
        self.w = cluster.data.initial_params()
        self.agent: WorkerAgent | None = None
        self.task: asyncio.Task[Any] | None = None
        self.completed = False
        self.ended = ""
        self.hang_s = 0.0
        self.straggle_factor = 1.0
        self.restarts = 0
        self.gone = False  # killed with restart = false

    # ---- lifecycle ----
    def start(self) -> None:
        c = self.cluster
        c.net.revive(self.node)
        self.w = c.data.initial_params()  # a fresh process has only its initial state
        host = SimHost(c.net, self.node, c.seed)
        cfg = WorkerConfig(worker_id=self.worker_id, coordinator_address=c.coordinator_address, heal_bind="heal",
                           connect_timeout_s=5.0, quorum_timeout_s=c.max_virtual_s, decision_timeout_s=30.0,
                           heal_timeout_s=10.0, reconnect_timeout_s=30.0, pid=10_000 + self.index)
        self.agent = WorkerAgent(host, cfg, lambda _addr: c.pgf.for_node(self.node), self._state)
        self.task = c.net.spawn(self.node, self._run(host), "loop")

    def crash(self) -> None:
        self.cluster.net.crash(self.node)
        self.agent = None

    @property
    def finished(self) -> bool:
        return self.task is not None and self.task.done() and self.node.alive

    def _state(self) -> tuple[bytes, list[memoryview]]:
        assert self.agent is not None
        return msgspec.json.encode({"step": self.agent.last_committed_step}), [memoryview(self.w.tobytes())]

    # ---- the step loop ----
    async def _run(self, host: SimHost) -> None:
        agent = self.agent
        assert agent is not None
        try:
            await agent.start()
        except (TransportError, asyncio.TimeoutError, OSError) as e:
            self.ended = f"could not reach the coordinator: {e}"
            return
        total = self.cluster.steps
        step = agent.last_committed_step + 1
        for _ in range(total * MAX_ATTEMPTS):
            if step >= total:
                break
            try:
                a = await agent.wait_for_quorum(step, total)
                await self._prepare(agent, a)
            except JobOver as e:
                self.ended = str(e)
                await agent.goodbye(False, str(e))
                return
            except CoordinatorLost:
                try:
                    await agent.reconnect()
                except CoordinatorLost as e:
                    self.ended = str(e)
                    return
                continue
            except (HealError, StaleEpoch, StateCorrupt, QuorumBroken, TransportError) as e:
                self.cluster.span(self.worker_id, "prepare_failed", host.now(), step=step, error=str(e))
                continue
            except PeerTimeout as e:
                self.ended = str(e)
                return
            step = a.step
            if step >= total:
                break
            if await self._attempt(host, agent, a):
                step += 1
        self.completed = step >= total
        self.ended = "finished" if self.completed else "gave up"
        await agent.goodbye(self.completed, self.ended)
        if self.completed:
            await agent.drain()  # stay to heal a late peer, like a real worker

    async def _prepare(self, agent: WorkerAgent, a: Assignment) -> None:
        t0 = agent.host.now()
        if a.heal_from:
            healed = await agent.heal(a)
            self.w = np.frombuffer(bytes(healed.buffers[0]), dtype=np.float64).copy()
            await agent.heal_done(a, healed.checksum)
            self.cluster.span(self.worker_id, "heal", t0, step=a.step, source=a.heal_from)
        if a.heal_targets:
            t1 = agent.host.now()
            await agent.serve_heals(a)
            self.cluster.span(self.worker_id, "heal_serve", t1, step=a.step)

    async def _attempt(self, host: SimHost, agent: WorkerAgent, a: Assignment) -> bool:
        c = self.cluster
        cfg = c.model_cfg
        gbs = cfg.global_batch_size
        offset, count = a.shard_bounds(gbs)  # even, or by measured speed in available mode
        gb = sharding.global_batch(a.step, cfg.dataset_size, gbs, cfg.seed)
        idx = gb[offset : offset + count]
        t0 = host.now()
        await host.sleep(c.compute_s(self, count))
        if self.hang_s > 0:  # hung inside the step, heartbeats still flowing
            hang, self.hang_s = self.hang_s, 0.0
            await host.sleep(hang)
        grad, loss = c.data.shard_gradient(self.w, idx)
        coverage = np.zeros(gbs)
        coverage[offset : offset + count] = idx + 1.0
        flat = np.concatenate([grad, coverage, [loss]])
        expected = gb + 1.0
        compute_s = host.now() - t0
        c.span(self.worker_id, "compute", t0, step=a.step, quorum_id=a.quorum_id)

        def verify(t: np.ndarray) -> tuple[bool, float]:
            return bool(np.array_equal(t[cfg.features : cfg.features + gbs], expected)), float(t[-1])

        t1 = host.now()
        try:
            decision = await agent.allreduce(a, flat, verify, compute_s)
        except (CoordinatorLost, PeerTimeout, CollectiveError):
            c.span(self.worker_id, "allreduce", t1, step=a.step, quorum_id=a.quorum_id, commit=False)
            return False
        c.span(self.worker_id, "allreduce", t1, step=a.step, quorum_id=a.quorum_id, commit=decision.commit)
        if not decision.commit:
            return False  # rolled back: parameters were not touched
        self.w = self.w - cfg.lr * flat[: cfg.features]
        agent.committed(a.step)
        c.on_worker_commit(self, a.step, a.quorum_id, params_digest(self.w))
        return True


def digest_lines(lines: list[str]) -> str:
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()
