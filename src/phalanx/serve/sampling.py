"""Sampling as a pure function of (seed, position, logits): any replica continues a generation alike.

The only randomness is one uniform number per generated position, drawn from a hash of
``(seed, index)`` rather than a stateful generator, so a replica that receives prompt + tokens so
far draws exactly what the first replica would have drawn next.
"""

from __future__ import annotations

import bisect
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
    """One sequence's next token: ``sample_tokens`` with a batch of one (the very same arithmetic)."""
    return sample_tokens(logits.reshape(1, -1), [params], [index])[0]


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], indices: list[int]) -> list[int]:
    """Each row's next token, for a batch (B, vocab) in a few tensor operations rather than ~10 per row.

    temperature 0 is greedy; otherwise nucleus (top_p) sampling by inverse CDF on ``uniform_for``.
    Row i's token depends on row i's logits, ``params[i]`` and ``indices[i]`` only, never on the other
    rows or the batch size (what stream resumption needs): every tensor operation used here works row
    by row (softmax, sort and cumsum along the last dimension) or is exact (division), and the rest is
    exact float comparison in Python (``bisect`` on each row's cumulative probabilities)."""
    temps = [p.temperature if p.temperature > 0.0 else 1.0 for p in params]
    # on the CPU whatever device the model runs on: a (B, vocab) copy, and the same arithmetic on
    # every replica (a CUDA replica's logits would otherwise meet CPU temperatures here)
    scaled = logits.detach().double().cpu() / torch.tensor(temps, dtype=torch.float64)[:, None]
    sorted_p, order = torch.sort(torch.softmax(scaled, dim=-1), dim=-1, descending=True, stable=True)
    cums, orders = torch.cumsum(sorted_p, dim=-1).tolist(), order.tolist()
    out = []
    for p, index, cum, row in zip(params, indices, cums, orders):
        if p.temperature <= 0.0:
            out.append(row[0])  # greedy: the most likely token (the first of equals)
            continue
        keep = min(bisect.bisect_left(cum, p.top_p) + 1, len(cum))  # the nucleus: top tokens reaching top_p
        target = uniform_for(p.seed, index) * cum[keep - 1]  # a uniform point in the nucleus's mass
        out.append(row[min(bisect.bisect_right(cum, target), keep - 1)])
    return out
