"""Per-chunk ring all-reduce: every message of every ring step simulated on the virtual loop.

The default SimProcessGroup charges the closed-form alpha-beta cost; this mode simulates the
2(p-1) steps of a ring reduce-scatter + all-gather, each rank sending one chunk of n/p bytes to its
right neighbour per step over a link with its own latency and bandwidth. It validates the formula
(equal for uniform links) and shows what a slow link does to the whole ring.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from phalanx.sim.loop import run_virtual


@dataclass(frozen=True)
class RingResult:
    ranks: int
    nbytes: int
    finish_s: float
    messages: int
    timer_events: int


def ring_allreduce_time(ranks: int, nbytes: int, alpha_s: Sequence[float] | float,
                        beta_s_per_byte: Sequence[float] | float, seed: int = 0) -> RingResult:
    """Virtual time for a ring all-reduce where link r -> r+1 has latency alpha[r] and inverse
    bandwidth beta[r]. A rank sends step k once it has sent step k-1 and received step k-1."""
    alphas = [alpha_s] * ranks if isinstance(alpha_s, (int, float)) else list(alpha_s)
    betas = [beta_s_per_byte] * ranks if isinstance(beta_s_per_byte, (int, float)) else list(beta_s_per_byte)
    assert len(alphas) == ranks and len(betas) == ranks, "one latency and bandwidth per ring link"
    steps = 2 * (ranks - 1)
    chunk = nbytes / ranks

    async def main() -> tuple[float, int]:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        sent = [0] * ranks  # steps each rank has sent
        received = [0] * ranks  # steps each rank has received
        link_free = [0.0] * ranks
        messages = [0]
        finished = [0]

        def try_send(r: int) -> None:
            k = sent[r]
            if k >= steps or received[r] < k:
                return
            now = loop.time()
            start = max(now, link_free[r])
            link_free[r] = start + chunk * betas[r]
            sent[r] = k + 1
            messages[0] += 1
            loop.call_at(link_free[r] + alphas[r], arrive, (r + 1) % ranks)
            if k + 1 == steps:
                note_done()

        def arrive(r: int) -> None:
            received[r] += 1
            if received[r] == steps:
                note_done()
            try_send(r)

        def note_done() -> None:
            finished[0] += 1
            if finished[0] == 2 * ranks:  # every rank sent and received its last chunk
                done.set_result(loop.time())

        for r in range(ranks):
            try_send(r)
        finish = await done
        return finish, messages[0]

    (finish, messages), loop = run_virtual(main(), seed)
    return RingResult(ranks, nbytes, finish, messages, loop.timer_events)


def ring_formula_s(ranks: int, nbytes: int, alpha_s: float, beta_s_per_byte: float) -> float:
    return 2 * (ranks - 1) * (alpha_s + nbytes / ranks * beta_s_per_byte)
