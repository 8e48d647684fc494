"""Plain torch DDP (Gloo) on a benchmark workload and the same global batches: the baseline peer.

    python -m phalanx.bench.ddp_worker RANK WORLD STORE_PORT STEPS OUT_JSON [WORKLOAD] [tuned|default]
                                       [tuned|default]

The first ``tuned`` (the default) sets glibc's malloc thresholds exactly as ``job.track()`` does for
phalanx's workers (train/host_memory.py), so the comparison measures the protocols, not which
process glibc's dynamic thresholds happened to favour; ``default`` leaves glibc's rule, as plain
DDP runs. The second ``tuned`` (the default) schedules the threads as ``phalanx.join()`` does:
the process group is built on a thread marked ``SCHED_BATCH`` (``mark_control_thread``), so
Gloo's threads inherit it, and the training thread's nice value goes up by 10
(``mark_compute_thread``); ``default`` leaves the OS's defaults, as plain DDP runs.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from phalanx.bench.step_clock import WARMUP_STEPS, StepClock
from phalanx.bench.workloads import build
from phalanx.runtime.worker_join import mark_compute_thread, mark_control_thread
from phalanx.train import host_memory, sharding


def main() -> None:
    rank, world, port, steps, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    name = sys.argv[6] if len(sys.argv) > 6 else "charlm"
    malloc = sys.argv[7] if len(sys.argv) > 7 else "tuned"
    sched = sys.argv[8] if len(sys.argv) > 8 else "tuned"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))

    def init() -> None:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)

    if sched == "tuned":  # built on a thread of its own, which alone is marked: Gloo's threads inherit it
        builder = threading.Thread(target=lambda: (mark_control_thread(True), init()), name="ddp-pg")
        builder.start()
        builder.join()
        mark_compute_thread({})  # nice +10, as phalanx.join() does for the training thread
    else:
        init()
    w = build(name)
    if malloc == "tuned":
        host_memory.tune_for_parameters(w.model.parameters())
    model = DistributedDataParallel(w.model)
    clock = StepClock()
    for step in range(steps):
        clock.mark(by_thread=step in (WARMUP_STEPS, steps - 1))  # loop top to loop top: everything a step costs
        idx = sharding.shard(step, w.dataset_size, w.global_batch_size, 0, rank, world)
        x, y = w.batch(idx)
        loss = w.loss(model(x), y)
        loss.backward()  # DDP averages over ranks: equal shards make it the global-batch mean
        w.optimizer.step()
        w.optimizer.zero_grad()
    clock.mark()
    timed = clock.intervals()
    with open(f"{out}.cpu{rank}", "w") as f:
        json.dump({k: timed[k] for k in ("cpu_s", "thread_cpu_s", "cpu_by_thread_s") if k in timed}, f)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_s": timed["step_s"], "parameters": w.parameters,
                       "final_loss": loss.item()}, f)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
