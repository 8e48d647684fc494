"""Rollout with real replica processes, a real router and the openai client: zero failed requests, and in
consistent mode no session ever sees an older version after a newer one."""

from __future__ import annotations

import asyncio
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from phalanx.checkpoint.durable import write_checkpoint
from phalanx.cli.main import main as cli
from phalanx.checkpoint.state_codec import capture_training_state
from phalanx.core.auth import read_token_file
from phalanx.serve.admin_client import request_rollout
from phalanx.serve.cluster import spawn_replicas, spawn_router, stop_replicas
from phalanx.serve.request_auth import ClusterTokenAuth
from phalanx.serve.served_model import random_model

MODEL = "phalanx-charlm"


def write_step(run_dir: Path, step: int, seed: int) -> Path:
    """A committed checkpoint of the bundled model (untrained weights ``seed``: each step differs)."""
    return write_checkpoint(run_dir, step, capture_training_state(random_model(seed).model, None, {}), {})


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("rollout") / "train-test"
    write_step(d, 1, 0)
    return d


def version_of(run_dir: Path, step: int) -> str:
    return f"{run_dir.name}/step_{step:08d}"


def start(run_dir: Path, token_file: Path, n: int, *router_args: str):
    reps = spawn_replicas(n, ["--checkpoint", str(run_dir / "checkpoints" / "step_00000001"), "--slowdown-factor", "4",
                              "--batch-size-max", "8"], token_file)
    try:
        router = spawn_router({r.replica_id: r.url for r in reps}, token_file, extra=list(router_args))
    except BaseException:
        stop_replicas(reps)
        raise
    return reps, router


async def sessions_under_load(url: str, stop: threading.Event, sessions: int = 9) -> tuple[dict[str, list[str]], list[str]]:
    """Each session sends requests one after another (odd ones streamed) until ``stop``; returns the version each
    response named, in order, per session, and every failure."""
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=3, timeout=60)
    seen: dict[str, list[str]] = {f"s{i}": [] for i in range(sessions)}
    failures: list[str] = []

    async def session(name: str, i: int) -> None:
        for n in range(2000):  # bounded; ends at stop
            if stop.is_set():
                return
            try:
                if (i + n) % 2:
                    versions = set()
                    stream = await c.completions.create(model=MODEL, prompt="The ", max_tokens=12, seed=n, user=name,
                                                        stream=True)
                    async for ch in stream:
                        versions.add(ch.system_fingerprint)
                    if len(versions) != 1:
                        failures.append(f"{name}: one stream, versions {versions}")
                    seen[name].append(versions.pop())
                else:
                    r = await c.completions.create(model=MODEL, prompt="x = ", max_tokens=8, seed=n, user=name)
                    seen[name].append(r.system_fingerprint)
            except openai.OpenAIError as e:
                failures.append(f"{name}: {type(e).__name__}: {e}")

    await asyncio.gather(*(session(f"s{i}", i) for i in range(sessions)))
    await c.close()
    return seen, failures


def regressions(seen: dict[str, list[str]], order: list[str]) -> int:
    """Responses that named an older version than one the same session had already seen."""
    count = 0
    for versions in seen.values():
        top = -1
        for v in versions:
            rank = order.index(v)
            count += rank < top
            top = max(top, rank)
    return count


def rollout_under_load(run_dir: Path, token_file: Path, mode: str, checkpoint: Path) -> tuple[dict, dict, int]:
    reps, router = start(run_dir, token_file, 3, "--consistency", mode)
    try:
        stop = threading.Event()
        result: dict = {}

        def roll() -> None:
            time.sleep(1.5)  # load first
            result["status"], result["report"] = request_rollout(router.url, read_token_file(token_file), str(checkpoint))
            time.sleep(1.0)  # and after
            stop.set()

        t = threading.Thread(target=roll)
        t.start()
        seen, failures = asyncio.run(sessions_under_load(router.url, stop))
        t.join(60)
        health = httpx.get(router.url + "/health", timeout=5).json()
    finally:
        router.stop()
        stop_replicas(reps)
    assert failures == []  # zero failed requests, streamed or not
    assert result["status"] == 200 and result["report"]["ok"], result
    old, new = version_of(run_dir, 1), version_of(run_dir, 2)
    assert {r["version"] for r in health["replicas"].values()} == {new}
    assert all(v in (old, new) for vs in seen.values() for v in vs)
    assert sum(v == old for vs in seen.values() for v in vs) > 0 and sum(v == new for vs in seen.values() for v in vs) > 0
    return result["report"], seen, regressions(seen, [old, new])


def test_rollout_under_load_fails_nothing_and_no_session_goes_back_a_version(run_dir, token_file):
    ckpt = write_step(run_dir, 2, 1) if not (run_dir / "checkpoints" / "step_00000002").exists() else \
        run_dir / "checkpoints" / "step_00000002"
    report, seen, back = rollout_under_load(run_dir, token_file, "consistent", ckpt)
    assert [s["replica"] for s in report["steps"]] == ["r0", "r1", "r2"]  # one at a time, in order
    assert back == 0, seen


@pytest.mark.slow
def test_rollout_in_available_mode_fails_nothing_and_counts_version_regressions(run_dir, token_file):
    ckpt = write_step(run_dir, 2, 1) if not (run_dir / "checkpoints" / "step_00000002").exists() else \
        run_dir / "checkpoints" / "step_00000002"
    report, seen, back = rollout_under_load(run_dir, token_file, "available", ckpt)
    print(f"available mode: {back} version regressions in {sum(len(v) for v in seen.values())} responses")
    assert report["ok"]


def test_a_corrupt_checkpoint_is_refused_and_the_old_weights_keep_serving(run_dir, token_file, tmp_path, capsys):
    bad = tmp_path / "train-bad" / "checkpoints" / "step_00000009"
    shutil.copytree(run_dir / "checkpoints" / "step_00000001", bad)
    data = bytearray((bad / "state.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (bad / "state.safetensors").write_bytes(bytes(data))
    reps, router = start(run_dir, token_file, 2)
    try:
        unsigned = httpx.post(router.url + "/phalanx/rollout", json={"checkpoint": str(bad)}, timeout=10)
        assert unsigned.status_code == 401  # admin routes demand the cluster token
        status, report = request_rollout(router.url, read_token_file(token_file), str(bad))
        assert status == 422 and not report["ok"] and "SHA-256" in report["error"]
        code = cli(["serve", "rollout", "--router", router.url.removeprefix("http://"), "--token-file", str(token_file),
                    "--checkpoint", str(bad)])  # the command line says so too, and exits non-zero
        out = capsys.readouterr().out
        assert code == 1 and "r0: FAILED" in out and "SHA-256" in out
        c = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=30)
        r = c.completions.create(model=MODEL, prompt="The ", max_tokens=4)
        assert r.system_fingerprint == version_of(run_dir, 1)
        health = httpx.get(router.url + "/health", timeout=5).json()["replicas"]
        assert all(h["version"] == version_of(run_dir, 1) and h["admitting"] for h in health.values())
    finally:
        router.stop()
        stop_replicas(reps)


def _wait_for(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # bounded
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_follow_rolls_out_each_new_checkpoint_of_a_running_training_job(tmp_path, token_file):
    run = tmp_path / "train-live"
    write_step(run, 1, 0)
    reps, router = start(run, token_file, 2, "--follow", str(run), "--follow-poll-s", "0.2")
    try:
        def versions() -> set[str]:
            return {h["version"] for h in httpx.get(router.url + "/health", timeout=5).json()["replicas"].values()}

        assert versions() == {version_of(run, 1)}
        write_step(run, 2, 1)  # training commits a new checkpoint
        _wait_for(lambda: versions() == {version_of(run, 2)}, 60, "every replica on step 2")
        write_step(run, 3, 2)
        _wait_for(lambda: versions() == {version_of(run, 3)}, 60, "every replica on step 3")
        c = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=30)
        assert c.completions.create(model=MODEL, prompt="The ", max_tokens=4).system_fingerprint == version_of(run, 3)
    finally:
        router.stop()
        stop_replicas(reps)


@pytest.mark.slow
def test_a_stream_resumed_mid_rollout_continues_on_its_own_version_only(run_dir, token_file):
    """r0 already serves step 2 (as mid-rollout); r1 is killed under streams of step 1: they resume on r2 (step 1),
    never on r0, so every stream is one version and byte-identical to the fault-free step-1 text."""
    if not (run_dir / "checkpoints" / "step_00000002").exists():
        write_step(run_dir, 2, 1)
    reps = spawn_replicas(3, ["--checkpoint", str(run_dir / "checkpoints" / "step_00000001"), "--slowdown-factor", "15",
                              "--batch-size-max", "16"], token_file)
    router = spawn_router({r.replica_id: r.url for r in reps}, token_file, extra=["--consistency", "available"])
    token = read_token_file(token_file)
    seeds = list(range(10))

    async def streams() -> dict[int, tuple[set[str], str]]:
        c = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=60)

        async def one(seed: int) -> tuple[int, tuple[set[str], str]]:
            versions, parts = set(), []
            stream = await c.completions.create(model=MODEL, prompt="The ", max_tokens=40, temperature=0.9, seed=seed,
                                                stream=True)
            async for ch in stream:
                versions.add(ch.system_fingerprint)
                parts.append(ch.choices[0].text if ch.choices else "")
            return seed, (versions, "".join(parts))

        out = dict(await asyncio.gather(*(one(s) for s in seeds)))
        await c.close()
        return out

    try:
        reference = asyncio.run(streams())  # every replica on step 1
        old, new = version_of(run_dir, 1), version_of(run_dir, 2)
        assert all(v == {old} for v, _ in reference.values())
        with httpx.Client(auth=ClusterTokenAuth(token), timeout=60) as c:  # r0 alone to step 2, as a rollout would
            assert c.post(reps[0].url + "/phalanx/load", json={"checkpoint": str(run_dir / "checkpoints" / "step_00000002")
                                                               }).json()["version"] == new
        _wait_for(lambda: httpx.get(router.url + "/health", timeout=5).json()["replicas"]["r0"] == {**httpx.get(
            router.url + "/health", timeout=5).json()["replicas"]["r0"], "healthy": True, "version": new}, 30,
            "r0 back in rotation on step 2")

        async def with_kill() -> dict[int, tuple[set[str], str]]:
            run = asyncio.create_task(streams())
            # kill r1 once streams run there and have produced tokens (a fixed 0.6 s could come before any stream
            # reached r1 on a loaded box: then nothing was resumed)
            async with httpx.AsyncClient(auth=ClusterTokenAuth(token), timeout=5) as hc:
                steps0 = (await hc.get(reps[1].url + "/health")).json()["steps"]
                for _ in range(600):  # bounded: 30 s
                    h = (await hc.get(reps[1].url + "/health")).json()
                    if h["batch_size"] > 0 and h["steps"] >= steps0 + 2:
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("no stream ran on r1 within 30 s")
            reps[1].proc.send_signal(signal.SIGKILL)
            return await run

        out = asyncio.run(with_kill())
        resumed = sum(float(x.split()[-1]) for x in httpx.get(router.url + "/metrics", timeout=5).text.splitlines()
                      if x.startswith("phalanx_router_stream_resumptions_total"))
    finally:
        router.stop()
        stop_replicas(reps)
    assert all(len(v) == 1 for v, _ in out.values())  # no stream mixes two versions' tokens
    on_old = [s for s, (v, _) in out.items() if v == {old}]
    assert on_old and all(out[s][1] == reference[s][1] for s in on_old)  # step-1 streams: the fault-free text
    assert resumed >= 1  # the kill really landed mid-stream
