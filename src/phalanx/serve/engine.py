"""The replica engine: continuous batching over a KV cache, one decode step at a time.

Requests wait in a bounded queue; before every decode step the engine admits waiting requests
into free cache slots (prefill) and drops finished or cancelled ones, so the running batch
changes at every step. The model runs in a worker thread so the HTTP loop stays responsive;
only the event loop touches the queues and the per-request state.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from dataclasses import dataclass, field

import torch

from phalanx.serve.errors import BadRequest, Draining, Overloaded
from phalanx.serve.kv_decoder import KvDecoder
from phalanx.serve.sampling import SamplingParams, sample_tokens
from phalanx.serve.served_model import ServedModel


@dataclass(frozen=True)
class EngineConfig:
    batch_size_max: int = 32  # cache slots: sequences decoded together in one step
    queue_depth_max: int = 64  # waiting requests beyond the running batch; more are refused (429)
    slowdown_factor: float = 1.0  # a straggler fault: every step takes this many times longer
    min_step_s: float = 0.0  # benchmarks: a step takes at least this long (a replica that mostly waits, as a GPU
    # replica's host does; a fixed pace keeps its service time steady on a busy box, where scaling the step's
    # own wall time multiplied every scheduling delay)


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" when this is the last delta


@dataclass(eq=False)  # compared by identity: one request's mutable state
class Generation:
    """One request's state inside the engine (event-loop owned)."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    generated: list[int]  # tokens so far, including any resumed from another replica
    out: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)
    text: str = ""  # text of the tokens generated here and not yet emitted past ``emitted``
    emitted: int = 0
    slot: int = -1
    cancelled: bool = False
    done: bool = False
    new_tokens: int = 0
    streamed: bool = True  # False: one Delta at the end (no per-token text, queue put and wake-up)


class ReplicaEngine:
    def __init__(self, served: ServedModel, cfg: EngineConfig = EngineConfig()) -> None:
        self.served = served
        self.cfg = cfg
        self.decoder = KvDecoder(served.model, cfg.batch_size_max)
        self.context = self.decoder.context
        self._waiting: collections.deque[Generation] = collections.deque()
        self._active: dict[int, Generation] = {}  # slot -> generation
        self._free = list(range(cfg.batch_size_max - 1, -1, -1))
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self.steps = 0
        self.tokens_generated = 0
        self.slowdown_factor = cfg.slowdown_factor  # a straggler fault may change it while serving
        self.hung_until_s = 0.0  # a hang fault: the decode loop stands still (heartbeats still answer)
        self.draining = False  # SIGTERM: no new requests; the running and waiting ones finish
        self.loading = False  # a rollout is swapping the weights: no new requests until the new ones are in
        self.step_time_s = 0.0  # EWMA of one decode step: the router's progress rule scales with it
        self.last_progress_s = time.monotonic()  # heartbeat + progress for the router's failure detector

    # --- introspection -------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def batch_size(self) -> int:
        return len(self._active)

    @property
    def is_idle(self) -> bool:
        return not self._active and not self._waiting

    @property
    def free_slots(self) -> int:
        return len(self._free)

    # --- requests ------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, resumed: list[int] | None = None,
               streamed: bool = True) -> Generation:
        """``streamed``: the caller reads a Delta as text becomes final; otherwise only the whole text at the end."""
        resumed = list(resumed or [])
        if self.draining:
            raise Draining("replica is draining (shutting down); send the request to another replica")
        if self.loading:
            raise Draining("replica is loading new weights (rollout); send the request to another replica")
        if not prompt_ids:
            raise BadRequest("prompt is empty")
        if len(prompt_ids) + max(params.max_tokens, len(resumed)) > self.context:
            raise BadRequest(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"model's context of {self.context} tokens; shorten the prompt or lower max_tokens")
        if len(self._waiting) >= self.cfg.queue_depth_max:
            raise Overloaded(f"replica queue is full ({self.cfg.queue_depth_max} waiting); retry shortly")
        gen = Generation(next(self._ids), list(prompt_ids), params, resumed, streamed=streamed)
        if len(resumed) >= params.max_tokens:
            self._finish(gen, "length")
            return gen
        self._waiting.append(gen)
        self._wake.set()
        return gen

    def cancel(self, gen: Generation) -> None:
        """The client went away: free its slot at the next step (idempotent)."""
        gen.cancelled = True
        self._wake.set()

    def swap_model(self, served: ServedModel) -> None:
        """Serve new weights from the next request on (a rollout); only while idle, so no generation
        ever mixes two versions' tokens and no KV-cache slot holds the old model's keys."""
        assert self.is_idle and self.loading, "swap_model needs an idle engine with admission closed"
        self.decoder = KvDecoder(served.model, self.cfg.batch_size_max)
        self.served = served
        self.context = self.decoder.context

    # --- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            if self.hung_until_s > time.monotonic():  # a hang fault, bounded by its for_s
                await asyncio.sleep(min(0.05, self.hung_until_s - time.monotonic()))
                continue
            self._reap_cancelled()
            admitted: list[Generation] = []
            while self._waiting and self._free:
                gen = self._waiting.popleft()
                if gen.cancelled:
                    self._finish(gen, "cancelled")
                    continue
                gen.slot = self._free.pop()
                self._active[gen.slot] = gen
                admitted.append(gen)
            if not self._active:
                self.last_progress_s = time.monotonic()
                self._wake.clear()
                await self._wake.wait()
                continue
            fresh = {id(g) for g in admitted}
            running = sorted((g for g in self._active.values() if id(g) not in fresh), key=lambda g: g.slot)
            t0 = time.monotonic()
            new_tokens = await asyncio.to_thread(self._step, admitted, running)
            if self.cfg.min_step_s > 0:
                await asyncio.sleep(self.cfg.min_step_s - (time.monotonic() - t0))
            if self.slowdown_factor > 1.0:
                await asyncio.sleep((self.slowdown_factor - 1.0) * (time.monotonic() - t0))
            self.steps += 1
            self.last_progress_s = time.monotonic()
            took_s = self.last_progress_s - t0
            self.step_time_s = took_s if self.steps == 1 else 0.8 * self.step_time_s + 0.2 * took_s
            for gen, tok in new_tokens:
                self._accept(gen, tok)

    def _step(self, admitted: list[Generation], running: list[Generation]) -> list[tuple[Generation, int]]:
        """Worker thread: prefill the newly admitted (equal lengths together), one batched decode for the
        rest, then sample every sequence's next token at once."""
        gens: list[Generation] = []
        logits = []
        by_length: dict[int, list[Generation]] = {}
        for gen in admitted:
            by_length.setdefault(len(gen.prompt_ids) + len(gen.generated), []).append(gen)
        for group in by_length.values():
            logits.append(self.decoder.prefill_many([g.slot for g in group], [g.prompt_ids + g.generated for g in group]))
            gens += group
        if running:  # sorted by slot: slots 0..B-1 decode on a view of the cache
            logits.append(self.decoder.decode([g.slot for g in running], [g.generated[-1] for g in running],
                                              [len(g.prompt_ids) + len(g.generated) - 1 for g in running]))
            gens += running
        toks = sample_tokens(logits[0] if len(logits) == 1 else torch.cat(logits), [g.params for g in gens],
                             [len(g.generated) for g in gens])
        return list(zip(gens, toks))

    def _accept(self, gen: Generation, tok: int) -> None:
        if gen.done:
            return
        gen.generated.append(tok)
        gen.new_tokens += 1
        self.tokens_generated += 1
        gen.text += self.served.vocab.decode([tok])
        stops = gen.params.stop
        for s in stops:
            at = gen.text.find(s, max(0, gen.emitted - len(s) + 1))
            if at >= 0:
                self._emit(gen, gen.text[gen.emitted:at], "stop")
                return
        if len(gen.generated) >= gen.params.max_tokens:
            self._emit(gen, gen.text[gen.emitted:], "length")
            return
        if not gen.streamed:
            return  # the whole text goes out at the end
        hold = max((len(s) for s in stops), default=1) - 1  # a stop string may still be forming
        upto = len(gen.text) - hold
        if upto > gen.emitted:
            self._emit(gen, gen.text[gen.emitted:upto], None)

    def _emit(self, gen: Generation, text: str, finish: str | None) -> None:
        ids = tuple(self.served.vocab.encode(text))
        gen.emitted += len(text)
        gen.out.put_nowait(Delta(text, ids, finish))
        if finish is not None:
            self._release(gen)
            gen.done = True

    def _finish(self, gen: Generation, reason: str) -> None:
        gen.out.put_nowait(Delta("", (), reason))
        gen.done = True
        self._release(gen)

    def _release(self, gen: Generation) -> None:
        if gen.slot >= 0 and self._active.get(gen.slot) is gen:
            del self._active[gen.slot]
            self._free.append(gen.slot)
        gen.slot = -1

    def _reap_cancelled(self) -> None:
        for gen in [g for g in self._active.values() if g.cancelled]:
            self._finish(gen, "cancelled")
        if any(g.cancelled for g in self._waiting):
            for gen in [g for g in self._waiting if g.cancelled]:
                self._finish(gen, "cancelled")
            self._waiting = collections.deque(g for g in self._waiting if not g.cancelled)
