"""``phalanx.join()``: the worker side of ``phalanx launch``. Builds the real seams (TCP transport,
RealHost, Gloo/NCCL process groups, network-fault wrappers) around the WorkerAgent, starts its
control thread, and returns the user's ``Job``. It lives here, not in train/, so the training
protocol never imports a concrete transport."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import random
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from phalanx.collectives.process_group import TorchProcessGroupFactory, backend_for
from phalanx.core import event_loop
from phalanx.core.auth import read_token_file
from phalanx.core.errors import ConfigError
from phalanx.train.api import Job
from phalanx.train.network_faults import NetworkFaults, NoNetworkFaults, network_faults_setting
from phalanx.train.worker_agent import WorkerAgent, WorkerConfig
from phalanx.transport.real_host import RealHost
from phalanx.transport.tcp import TcpTransport, TlsFiles


CONTROL_THREAD_NAME = "phalanx-control"  # the thread that runs the worker's event loop (benchmarks find it by name)
COMPUTE_NICE_DEFAULT = 10


def mark_compute_thread(env: Mapping[str, str]) -> str:
    """Put the calling thread, the user's training loop, below phalanx's control plane in the
    OS scheduler, and say what was done (for the worker's span log).

    ``PHALANX_COMPUTE_NICE`` (default 10, 0 = leave it alone): the thread's nice value goes up by
    that much. Where busy threads outnumber cores, a training thread woken by its step's verdict
    took the core of the coordinator, still sending that verdict to the other workers, or of a
    control thread about to report, and the whole step waited for the last worker to hear
    (docs/BENCHMARKS.md, session 18: the bundled model 6 % and 3 % faster at 2 and 4 workers on 2
    cores). The control thread, started before, keeps its priority; processes and threads the
    training thread starts later inherit the new value. Raising a nice value needs no privilege,
    and lowering it again does, so it holds for the rest of the process. Linux only: there the
    call names one thread (elsewhere it would renice the whole process, control thread too).

    ``PHALANX_BATCH_SCHEDULING=1`` (opt-in) also marks it ``SCHED_BATCH`` (session 13: mixed)."""
    nice_s = env.get("PHALANX_COMPUTE_NICE", str(COMPUTE_NICE_DEFAULT))
    try:
        nice = int(nice_s)
    except ValueError:
        nice = -1
    if not 0 <= nice <= 19:
        raise ConfigError(f"PHALANX_COMPUTE_NICE={nice_s!r}: use a whole number from 0 (leave the training "
                          f"thread's priority alone) to 19; the default is {COMPUTE_NICE_DEFAULT}")
    batch = env.get("PHALANX_BATCH_SCHEDULING", "0")
    if batch not in ("0", "1"):
        raise ConfigError(f"PHALANX_BATCH_SCHEDULING={batch!r}: use 0 (the default) or 1")
    done = []
    if nice and sys.platform.startswith("linux"):
        tid = threading.get_native_id()
        try:
            before = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(before + nice, 19))
            done.append(f"nice {before} -> {os.getpriority(os.PRIO_PROCESS, tid)}")
        except OSError as e:
            done.append(f"nice unchanged ({e.strerror})")
    if batch == "1" and hasattr(os, "SCHED_BATCH"):
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # 0: the calling thread
            done.append("SCHED_BATCH")
        except OSError as e:
            done.append(f"SCHED_BATCH refused ({e.strerror})")
    return ", ".join(done) or "unchanged"


def control_batch(env: Mapping[str, str]) -> bool:
    """Whether the control thread runs ``SCHED_BATCH`` (``PHALANX_CONTROL_BATCH``, default 1; see
    :func:`mark_control_thread`). Read in the caller's thread, so a bad value raises before any
    thread starts."""
    value = env.get("PHALANX_CONTROL_BATCH", "1")
    if value not in ("0", "1"):
        raise ConfigError(f"PHALANX_CONTROL_BATCH={value!r}: use 1 (the default) or 0 (leave the control "
                          "thread's scheduling alone)")
    return value == "1"


def mark_control_thread(batch: bool) -> str:
    """Run first on the control thread: mark it ``SCHED_BATCH``, so that neither it nor the threads
    it starts (the process groups' builders, hence Gloo's own threads, which inherit the policy)
    preempt a running thread when a frame or a tensor chunk wakes them; they take a core when
    one frees up or at the running thread's next tick. Say what was done (the span log).

    Where busy threads outnumber cores, every such wakeup took the core of whoever ran: the
    coordinator fanning the verdict out to the other workers, or another rank's Gloo thread
    mid-exchange. The bundled model at 4 workers on 2 cores went from 32.6 to 28.2 ms a step
    (docs/BENCHMARKS.md, session 20). Nothing waits longer for it where cores are free: a woken
    thread goes to an idle core either way. Switching to ``SCHED_BATCH`` needs no privilege."""
    if not batch or not hasattr(os, "SCHED_BATCH"):
        return "unchanged"
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # 0: the calling thread only
        return "SCHED_BATCH"
    except OSError as e:
        return f"SCHED_BATCH refused ({e.strerror})"


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
    seams = network_faults_setting(env)  # likewise
    run_dir = Path(env.get("PHALANX_RUN_DIR", "runs/latest"))
    data_seed = int(env.get("PHALANX_DATA_SEED", "0"))
    batch = control_batch(env)
    loop = event_loop.new_event_loop()  # uvloop's when installed: the step's control hops are loop work
    marked: concurrent.futures.Future[str] = concurrent.futures.Future()

    def control() -> None:
        marked.set_result(mark_control_thread(batch))  # before the loop starts any thread
        loop.run_forever()

    thread = threading.Thread(target=control, name=CONTROL_THREAD_NAME, daemon=True)
    thread.start()
    compute = mark_compute_thread(env)  # after the control thread started: it keeps its priority
    transport = TcpTransport(token, name=worker_id, tls=TlsFiles.from_env(env))  # TLS if PHALANX_TLS_* are set
    host = RealHost(worker_id, transport)
    # network faults act at the seams: host.transport becomes a FaultyTransport, groups are wrapped
    # (only when the launcher's plan may send one: PHALANX_NETWORK_FAULTS)
    net = (NetworkFaults.install(host, coordinator, random.Random(f"net:{data_seed}:{worker_id}")) if seams
           else NoNetworkFaults())
    cfg = WorkerConfig(worker_id=worker_id, coordinator_address=coordinator,
                       heal_bind=env.get("PHALANX_HEAL_BIND", "127.0.0.1:0"))
    agent = WorkerAgent(host, cfg, lambda addr, run_id: net.wrap(
        TorchProcessGroupFactory(addr, token, backend=backend, run_id=run_id)))
    job = Job(agent, loop, run_dir, data_seed, worker_id)
    net.log = job._spans.event
    job._spans.event("compute_thread", detail=compute)
    job._spans.event("control_thread", detail=marked.result(timeout=10))
    job._spans.event("network_seams", detail="on" if seams else "off (PHALANX_NETWORK_FAULTS=0)")
    agent._on_fault = net.route(job.faults.on_fault)  # called on the control thread
    job.faults.install()
    asyncio.run_coroutine_threadsafe(agent.start(), loop).result(
        timeout=cfg.reconnect_timeout_s + 2 * cfg.connect_timeout_s)
    return job
