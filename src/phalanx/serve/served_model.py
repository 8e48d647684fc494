"""Rebuild the trained char transformer from a run directory or a checkpoint folder.

The checkpoint manifest does not record the model config, so it is read back from the tensor
shapes (vocabulary, context, width, depth, MLP width); the head count is the training default.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint.durable import latest_checkpoint, read_checkpoint
from phalanx.checkpoint.state_codec import unflatten_state
from phalanx.core.errors import CheckpointError
from phalanx.serve.errors import NoCheckpoint
from phalanx.workload.corpus import CharVocab, load_corpus
from phalanx.workload.model import CharLMConfig, CharTransformer, build_model


@dataclass(frozen=True)
class ServedModel:
    model: CharTransformer
    cfg: CharLMConfig
    vocab: CharVocab
    version: str  # names the weights: "<run>/step_<n>" (every response carries it)


def find_checkpoint(path: str | Path | None, runs_dir: Path = Path("runs")) -> Path:
    """A checkpoint folder, a run directory (its latest good checkpoint) or None (latest runs/train-*)."""
    if path is None:
        runs = sorted(runs_dir.glob("train-*")) if runs_dir.is_dir() else []
        for run in reversed(runs):
            found = latest_checkpoint(run)
            if found is not None:
                return found[0]
        raise NoCheckpoint(f"no checkpoint under {runs_dir}/train-*: run `phalanx train` first "
                           "(or pass --checkpoint RUN_DIR_OR_CHECKPOINT)")
    p = Path(path)
    if (p / "manifest.json").is_file():
        return p
    found = latest_checkpoint(p)
    if found is None:
        raise NoCheckpoint(f"{p}: neither a checkpoint folder nor a run directory with a committed checkpoint; "
                           "run `phalanx train` first")
    return found[0]


def config_from_state(sd: dict[str, torch.Tensor], n_heads: int = 4) -> CharLMConfig:
    vocab_size, d_model = sd["tok.weight"].shape
    n_layers = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    return CharLMConfig(vocab_size=int(vocab_size), context_len=int(sd["pos.weight"].shape[0]), d_model=int(d_model),
                        n_heads=n_heads, n_layers=n_layers, d_ff=int(sd["blocks.0.mlp.0.weight"].shape[0]))


def load_served_model(path: str | Path | None, device: str = "cpu") -> ServedModel:
    ckpt = find_checkpoint(path)
    step, state, _ = read_checkpoint(ckpt)
    obj: Any = unflatten_state(state.tree, state.tensors)
    sd = obj.get("model") if isinstance(obj, dict) else None
    if not isinstance(sd, dict) or "tok.weight" not in sd:
        raise CheckpointError(f"{ckpt}: holds no char-transformer weights ('model' state dict missing)")
    cfg = config_from_state(sd)
    vocab = CharVocab.from_text(load_corpus())
    if len(vocab) != cfg.vocab_size:
        raise CheckpointError(f"{ckpt}: vocabulary of {cfg.vocab_size} does not match the bundled corpus ({len(vocab)})")
    model = build_model(cfg)
    model.load_state_dict(sd)
    model.train(False).to(device)  # inference mode (no dropout here anyway)
    return ServedModel(model, cfg, vocab, f"{ckpt.parent.parent.name}/{ckpt.name}")


def random_model(seed: int = 0) -> ServedModel:
    """Untrained weights (tests and benchmarks that need no training run)."""
    vocab = CharVocab.from_text(load_corpus())
    cfg = CharLMConfig(vocab_size=len(vocab), seed=seed)
    return ServedModel(build_model(cfg).train(False), cfg, vocab, f"random-{seed}")
