"""Plain torch DDP (Gloo) on the bundled model and the same global batches: the baseline peer."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from phalanx.train import sharding
from phalanx.workload.charlm_train import build
from phalanx.workload.model import build_model, build_optimizer, loss_fn


def main() -> None:
    rank, world, port, steps, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    cfg, data = build()
    model = DistributedDataParallel(build_model(cfg))
    opt = build_optimizer(model.module, cfg)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        idx = sharding.shard(step, len(data), cfg.global_batch_size, 0, rank, world)
        x, y = data.batch(idx)
        loss = loss_fn(model(x), y)
        loss.backward()  # DDP averages over ranks: equal shards make it the global-batch mean
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_s": times}, f)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
