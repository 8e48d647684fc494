"""``phalanx.join()``: the worker side of ``phalanx launch``. Builds the real seams (TCP transport,
RealHost, Gloo/NCCL process groups, network-fault wrappers) around the WorkerAgent, starts its
control thread, and returns the user's ``Job``. It lives here, not in train/, so the training
protocol never imports a concrete transport."""

from __future__ import annotations

import asyncio
import os
import random
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from phalanx.collectives.process_group import TorchProcessGroupFactory, backend_for
from phalanx.core import event_loop
from phalanx.core.auth import read_token_file
from phalanx.core.errors import ConfigError
from phalanx.train.api import Job
from phalanx.train.network_faults import NetworkFaults
from phalanx.train.worker_agent import WorkerAgent, WorkerConfig
from phalanx.transport.real_host import RealHost
from phalanx.transport.tcp import TcpTransport, TlsFiles


def mark_compute_thread(env: Mapping[str, str]) -> bool:
    """With ``PHALANX_BATCH_SCHEDULING=1``, mark the calling thread, the user's training loop,
    ``SCHED_BATCH``: CPU-bound work that does not preempt the threads it wakes. Where busy threads
    outnumber cores, a training thread woken by its step's verdict can take the core of the
    coordinator, still sending that verdict to the other workers, or of its own control thread.
    Measured on 2 cores (docs/BENCHMARKS.md, session 13): 4 workers of the bundled model 3-10 %
    faster in three pairs, the 6 M-parameter MLP no better or worse, so it is off by default. Its
    CPU share is unchanged. Threads it starts later inherit the policy; the control thread, started
    before, keeps the default. An OS without SCHED_BATCH leaves the thread alone. Returns whether
    the policy was set."""
    setting = env.get("PHALANX_BATCH_SCHEDULING", "0")
    if setting not in ("0", "1"):
        raise ConfigError(f"PHALANX_BATCH_SCHEDULING={setting!r}: use 0 (the default) or 1")
    if setting == "0" or not hasattr(os, "SCHED_BATCH"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # 0: the calling thread
    except OSError:
        return False
    return True


def join(**overrides: Any) -> Job:
    """Join the cluster this process was started into by ``phalanx launch`` (reads PHALANX_* env)."""
    env = {**os.environ, **{k.upper(): str(v) for k, v in overrides.items()}}
    try:
        coordinator = env["PHALANX_COORDINATOR"]
        token = read_token_file(env["PHALANX_TOKEN_FILE"])
        worker_id = env["PHALANX_WORKER_ID"]
    except KeyError as e:
        raise ConfigError(f"{e.args[0]} is not set: start this script with `phalanx launch -- python SCRIPT`") from e
    backend = env.get("PHALANX_BACKEND", "auto")  # auto: NCCL for CUDA tensors, Gloo for CPU ones
    backend_for(backend, "cpu")  # a bad value is a ConfigError now, before any thread starts
    run_dir = Path(env.get("PHALANX_RUN_DIR", "runs/latest"))
    data_seed = int(env.get("PHALANX_DATA_SEED", "0"))
    loop = event_loop.new_event_loop()  # uvloop's when installed: the step's control hops are loop work
    thread = threading.Thread(target=loop.run_forever, name="phalanx-control", daemon=True)
    thread.start()
    mark_compute_thread(env)  # opt-in; after the control thread started: it keeps the default policy
    transport = TcpTransport(token, name=worker_id, tls=TlsFiles.from_env(env))  # TLS if PHALANX_TLS_* are set
    host = RealHost(worker_id, transport)
    # network faults act at the seams: host.transport becomes a FaultyTransport, groups are wrapped
    net = NetworkFaults.install(host, coordinator, random.Random(f"net:{data_seed}:{worker_id}"))
    cfg = WorkerConfig(worker_id=worker_id, coordinator_address=coordinator,
                       heal_bind=env.get("PHALANX_HEAL_BIND", "127.0.0.1:0"))
    agent = WorkerAgent(host, cfg, lambda addr, run_id: net.wrap(
        TorchProcessGroupFactory(addr, token, backend=backend, run_id=run_id)))
    job = Job(agent, loop, run_dir, data_seed, worker_id)
    net.log = job._spans.event
    agent._on_fault = net.route(job.faults.on_fault)  # called on the control thread
    job.faults.install()
    asyncio.run_coroutine_threadsafe(agent.start(), loop).result(
        timeout=cfg.reconnect_timeout_s + 2 * cfg.connect_timeout_s)
    return job
