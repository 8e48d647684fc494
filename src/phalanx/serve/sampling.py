"""Sampling as a pure function of (seed, position, logits): any replica continues a generation alike.

The only randomness is one uniform number per generated position, drawn from a hash of
``(seed, index)`` rather than a stateful generator, so a replica that receives prompt + tokens so
far draws exactly what the first replica would have drawn next.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int = 0


def uniform_for(seed: int, index: int) -> float:
    """A uniform number in [0, 1) determined by (seed, index of the generated token)."""
    digest = hashlib.blake2b(struct.pack("<qq", seed & 0x7FFFFFFFFFFFFFFF, index), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def sample_token(logits: torch.Tensor, params: SamplingParams, index: int) -> int:
    """temperature 0 is greedy; otherwise nucleus (top_p) sampling by inverse CDF on ``uniform_for``."""
    if params.temperature <= 0.0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    order = torch.argsort(probs, descending=True, stable=True)
    sorted_p = probs[order]
    cum = torch.cumsum(sorted_p, dim=0)
    keep = int(torch.searchsorted(cum, torch.tensor(params.top_p, dtype=cum.dtype)).item()) + 1
    keep = max(1, min(keep, sorted_p.numel()))
    kept = sorted_p[:keep] / sorted_p[:keep].sum()
    u = uniform_for(params.seed, index)
    pick = int(torch.searchsorted(torch.cumsum(kept, dim=0), torch.tensor(u, dtype=kept.dtype), right=True).item())
    return int(order[min(pick, keep - 1)].item())
