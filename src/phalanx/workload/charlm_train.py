"""The bundled training script: a char-level transformer trained through the public API.

Run under ``phalanx launch --workers N -- python -m phalanx.workload.charlm_train --steps S``; this
is exactly what ``phalanx train`` does. It is also the example of how a user's loop changes: the
four marked lines are all that differ from a single-process loop.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import phalanx
from phalanx.workload.corpus import CharDataset, CharVocab, load_corpus
from phalanx.workload.model import CharLMConfig, build_model, build_optimizer, loss_fn


def build(context_len: int = 64, seed: int = 0, global_batch_size: int = 32) -> tuple[CharLMConfig, CharDataset]:
    text = load_corpus()
    vocab = CharVocab.from_text(text)
    cfg = CharLMConfig(vocab_size=len(vocab), context_len=context_len, seed=seed, global_batch_size=global_batch_size)
    return cfg, CharDataset(text, vocab, context_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--global-batch-size", type=int, default=32)
    ap.add_argument("--min-step-s", type=float, default=0.0,
                    help="pace each step to at least this long with every worker in (emulates a larger model's "
                         "compute; a larger or smaller share of the batch is paced in proportion)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="all-reduce the gradients after the backward pass instead of in buckets during it "
                         "(job.track(..., overlap=False); the lab's latency experiment compares the two)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg, data = build(seed=args.seed, global_batch_size=args.global_batch_size)
    model = build_model(cfg)
    optimizer = build_optimizer(model, cfg)

    job = phalanx.join()                                          # phalanx line 1
    job.track(model=model, optimizer=optimizer, overlap=not args.no_overlap)  # phalanx line 2
    for step in job.steps(args.steps):                            # phalanx line 3
        idx = step.shard(len(data), cfg.global_batch_size)        # phalanx line 4
        x, y = data.batch(idx)
        loss = loss_fn(model(x), y)
        loss.backward()
        _pace(step, args.min_step_s)
        step.allreduce_gradients(model, loss=loss)                # phalanx line 5
        optimizer.step()
        optimizer.zero_grad()
    job.save_final()  # RUN/final_<worker>.safetensors: the final model (steps() raised if it is not)
    (job.run_dir / "workers" / f"{job.worker_id}.counters.json").write_text(json.dumps(vars(job.counters)))
    job.close()


def _pace(step: "phalanx.train.api.Step", min_step_s: float) -> None:
    """Emulated compute scales with this worker's share of the batch, as a real model's would."""
    if min_step_s > 0:
        left = min_step_s * step.relative_share - (time.monotonic() - step.started_s)
        if left > 0:
            time.sleep(left)


if __name__ == "__main__":
    main()
