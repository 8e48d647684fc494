"""The same workload through phalanx's public API (the README quickstart loop), timed the same way
as the DDP baseline: loop top to loop top on every worker.

    phalanx launch --workers N -- python -m phalanx.bench.phx_worker STEPS WORKLOAD [DEVICE]

DEVICE (default cpu) may be ``cuda``: each worker then uses GPU ``index % device_count``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch

import phalanx
from phalanx.bench.step_clock import WARMUP_STEPS, StepClock
from phalanx.bench.workloads import build


def main() -> None:
    steps, name = int(sys.argv[1]), sys.argv[2]
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('PHALANX_WORKER_INDEX', '0')) % torch.cuda.device_count()}"
    torch.set_num_threads(1)
    w = build(name, device)
    job = phalanx.join()
    job.track(model=w.model, optimizer=w.optimizer)
    clock = StepClock()
    loss = torch.zeros(())
    for step in job.steps(steps):
        clock.mark(by_thread=step.number in (WARMUP_STEPS, steps - 1))  # the measured steps' ends
        idx = step.shard(w.dataset_size, w.global_batch_size)
        x, y = w.batch(idx)
        loss = w.loss(w.model(x), y)
        loss.backward()
        step.allreduce_gradients(w.model, loss=loss)
        w.optimizer.step()
        w.optimizer.zero_grad()
    clock.mark()
    digest = hashlib.sha256()
    for p in w.model.parameters():  # the final model, to compare workers
        digest.update(p.detach().cpu().numpy().tobytes())
    (job.run_dir / "workers" / f"{job.worker_id}.steps.json").write_text(json.dumps(
        {**clock.intervals(), "parameters": w.parameters, "device": device,
         "final_loss": loss.item(), "params_sha256": digest.hexdigest(), "retried": job.counters.steps_retried}))
    job.close()


if __name__ == "__main__":
    main()
