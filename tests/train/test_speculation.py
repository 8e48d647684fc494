"""Speculative commit (train/speculation.py): a step's True before its verdict, taken back when
the verdict is an abort or the next grant differs from the guess, leaves exactly the model a
plain loop makes.

The bridge (``Job``) runs here against a scripted engine on a real asyncio loop thread, so each
outcome happens on the step the test names: the real engine and coordinator are covered by the
integration tests, which decide nothing on cue."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from phalanx.collectives.process_group import LocalProcessGroup
from phalanx.core.errors import ConfigError
from phalanx.train import sharding
from phalanx.train.api import Job
from phalanx.train.assignment import Assignment
from phalanx.train.exchange import Exchange
from phalanx.train.speculation import StateSnapshot, setting_from_env
from phalanx.train.step_engine import Counters, Ticket, Vote

GBS, STEPS, SEED = 8, 12, 7


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)


def _assign(step: int, span: tuple[float, ...] = ()) -> Assignment:
    return Assignment(step, 1, ("w0",), 0, "", "", (), "", False, span)


class ScriptedEngine:
    """What the bridge needs of StepEngine: ``run``, ``vote``, ``asks_next``. ``script`` maps
    (step, attempt) to the verdict: commit (with the next grant, the fast path), abort, regrant
    (commit; the next grant comes the slow way) or reshard (commit; the next grant has another shard
    span than the guess)."""

    mode, last, max_world_size, ended_reason = "strict", None, 1, ""

    def __init__(self, body: object, script: dict[tuple[int, int], str], verdict_s: float) -> None:
        self.body, self.script, self.verdict_s = body, script, verdict_s
        self.counters, self.completed = Counters(), False
        self.total, self.attempts = 0, Counter[int]()
        self.committed: list[int] = []
        self.aborted: list[int] = []
        self._handed: Ticket | None = None

    def asks_next(self, a: Assignment) -> int:
        return a.step + 1 if a.step + 1 < self.total else -1

    async def run(self, total: int) -> None:
        self.total, step = total, 0
        while step < total:
            h, self._handed = self._handed, None
            fresh = Ticket(_assign(step), step, exchange=Exchange(LocalProcessGroup(1)))
            t = h if h is not None and h.step == step else fresh
            result = await self.body.run(t)  # type: ignore[attr-defined]
            if result.committed:
                self.committed.append(step)
                step += 1
            else:
                self.aborted.append(step)
                self._handed = None
        self.completed = True

    async def vote(self, a: Assignment, ex: Exchange, tail: object, verify: object, compute_s: float) -> Vote:
        await ex.complete(5.0, time.monotonic)
        ok, loss = verify()  # type: ignore[operator]
        await asyncio.sleep(self.verdict_s)  # the verdict's round trip
        kind = self.script.get((a.step, self.attempts[a.step]), "commit")
        self.attempts[a.step] += 1
        if kind == "abort" or not ok:
            return Vote(False, "scripted abort")
        nxt = self.asks_next(a)
        if nxt < 0 or kind == "regrant":
            return Vote(True, "", loss, None)
        t = Ticket(_assign(nxt, (0.0, 1.0) if kind == "reshard" else ()), nxt,
                   exchange=Exchange(LocalProcessGroup(1)), handed=True)
        self._handed = t
        return Vote(True, "", loss, t)


def _train_with_job(tmp_path, script: dict[tuple[int, int], str],
                    verdict_s: float = 0.003) -> tuple[torch.nn.Module, ScriptedEngine, str]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        agent = SimpleNamespace(state_provider=None, last_committed_step=-1, welcome=None, collective_timeout_s=5.0,
                                entering_allreduce=lambda step, qid, ex: None, quorum_gone=lambda qid: False)
        job = Job(agent, loop, tmp_path, SEED, "w0")  # type: ignore[arg-type]
        engine = ScriptedEngine(job._body, script, verdict_s)
        job.engine = engine  # type: ignore[assignment]
        model, (x, y) = _model(), _data()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        job.track(model, opt)
        torch.manual_seed(3)
        for step in job.steps(STEPS):
            idx = step.shard(len(x), GBS)
            loss = F.mse_loss(model(x[idx]), y[idx])
            loss.backward()
            if step.allreduce_gradients(model, loss):
                opt.step()
            opt.zero_grad()
        job.close()
        return model, engine, (tmp_path / "workers" / "w0.jsonl").read_text()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def _reference() -> torch.nn.Module:
    model, (x, y) = _model(), _data()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    torch.manual_seed(3)
    for s in range(STEPS):
        idx = np.array(sharding.global_batch(s, len(x), GBS, SEED))
        loss = F.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def _assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("script", [
    {},
    {(3, 0): "abort"},  # taken back: step 3 runs again from the snapshot
    {(3, 0): "abort", (3, 1): "abort", (7, 0): "abort"},
    {(4, 0): "regrant"},  # committed, but the guess for step 5 is not what was granted
    {(5, 0): "reshard", (8, 0): "abort"},
], ids=["clean", "abort", "aborts", "regrant", "reshard-then-abort"])
def test_speculation_taken_back_leaves_the_plain_loops_model(tmp_path, monkeypatch, script):
    monkeypatch.setenv("PHALANX_SPECULATE", "on")
    model, engine, spans = _train_with_job(tmp_path, script)
    _assert_same(model, _reference())
    assert engine.committed == list(range(STEPS))  # every step once, in order
    assert sorted(engine.aborted) == sorted(s for (s, _), k in script.items() if k == "abort")
    assert spans.count('"speculative": true') >= STEPS - 1 - len(script)  # it did speculate
    # a reshard is undone twice: the grant after it goes back to the even shard the guess does not expect
    assert spans.count("speculation_undone") == len(script) + list(script.values()).count("reshard")


def test_speculation_off_votes_the_plain_way(tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_SPECULATE", "off")
    model, engine, spans = _train_with_job(tmp_path, {(3, 0): "abort"})
    _assert_same(model, _reference())
    assert engine.aborted == [3]
    assert '"speculative": true' not in spans


def test_snapshot_restores_parameters_optimizer_state_and_hyperparameters():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    snap = StateSnapshot(model, opt, 1 << 20)
    x, y = _data()

    def step() -> None:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    assert snap.take()  # before the first step: no optimizer state yet
    step()
    snap.restore()
    assert not opt.state  # a parameter that had no state has none again
    step()
    params = [p.detach().clone() for p in model.parameters()]
    state = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(model.parameters())}
    assert snap.take()
    opt.param_groups[0]["lr"] = 1.0  # a scheduler's change is taken back too
    step()
    snap.restore()
    assert opt.param_groups[0]["lr"] == 0.05
    for i, p in enumerate(model.parameters()):
        assert torch.equal(p, params[i])
        for k, v in opt.state[p].items():
            assert torch.equal(v, state[i][k]), k
    assert not StateSnapshot(model, opt, 64).take()  # past its limit it takes nothing


def test_speculate_setting_is_checked(monkeypatch):
    monkeypatch.setenv("PHALANX_SPECULATE", "lots")
    with pytest.raises(ConfigError, match="PHALANX_SPECULATE"):
        setting_from_env()
    for v in ("on", "off"):
        monkeypatch.setenv("PHALANX_SPECULATE", v)
        assert setting_from_env() == v
    monkeypatch.delenv("PHALANX_SPECULATE")
    assert setting_from_env() == "off"
