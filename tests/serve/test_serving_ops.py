"""Router operations with real processes, real uvicorn and the official openai client: the client API
key, 429 + Retry-After under a flood, a client disconnect cancelling the replica's work, fault plans
(hang, partition) costing no request, and a graceful drain on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import openai
import pytest

from phalanx.serve.cluster import spawn_replicas, spawn_router, stop_replicas
from phalanx.serve.fault_driver import run_fault_plan
from phalanx.serve.request_auth import ClusterTokenAuth
from phalanx.serve.serving_faults import load_serving_faults

MODEL = "phalanx-charlm"
KEY = "sk-phalanx-test"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    tf = tmp_path_factory.mktemp("ops") / "t"
    tf.mkdir()
    from phalanx.serve.cluster import make_token_file

    token_file = make_token_file(tf)
    reps = spawn_replicas(3, ["--random-weights", "0", "--slowdown-factor", "10", "--batch-size-max", "16"], token_file)
    router = spawn_router({r.replica_id: r.url for r in reps}, token_file,
                          extra=["--api-key", KEY, "--active-requests-max", "12"])
    from phalanx.core.auth import read_token_file

    yield reps, router.url, read_token_file(token_file)
    router.stop()
    stop_replicas(reps)


def _client(url: str, key: str = KEY, retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=retries, timeout=60)


async def _mixed(url: str, seeds: list[int]) -> dict[tuple[str, int], str]:
    c = _client(url)

    async def stream(seed: int) -> tuple[tuple[str, int], str]:
        parts = []
        s = await c.completions.create(model=MODEL, prompt="The ", max_tokens=30, temperature=0.9, seed=seed, stream=True)
        async for ch in s:
            parts.append(ch.choices[0].text if ch.choices else "")
        return ("stream", seed), "".join(parts)

    async def unary(seed: int) -> tuple[tuple[str, int], str]:
        r = await c.completions.create(model=MODEL, prompt="x = ", max_tokens=20, temperature=0.9, seed=seed)
        return ("unary", seed), r.choices[0].text

    out = dict(await asyncio.gather(*(stream(s) for s in seeds), *(unary(s) for s in seeds)))
    await c.close()
    return out


def _healthy(url: str, rid: str) -> bool:
    return httpx.get(url + "/health", timeout=5).json()["replicas"][rid]["healthy"]


def test_public_port_wants_the_api_key_and_health_stays_open(ops):
    _, url, _ = ops
    with pytest.raises(openai.AuthenticationError):
        asyncio.run(_client(url, key="sk-wrong").completions.create(model=MODEL, prompt="a", max_tokens=2))
    r = asyncio.run(_client(url).completions.create(model=MODEL, prompt="a", max_tokens=2))
    assert len(r.choices[0].text) == 2
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    assert httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "a"}, timeout=5).status_code == 401


def test_flood_past_the_admission_limit_gets_429_with_retry_after_which_the_openai_client_honours(ops):
    _, url, _ = ops

    async def flood() -> list[int]:
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as h:
            body = {"model": MODEL, "prompt": "a", "max_tokens": 30, "temperature": 0}
            rs = await asyncio.gather(*(h.post(url + "/v1/completions", json=body) for _ in range(30)))
        assert all(r.headers.get("retry-after") for r in rs if r.status_code == 429)
        return [r.status_code for r in rs]

    codes = asyncio.run(flood())
    assert set(codes) == {200, 429}, codes

    async def patient() -> list[str]:
        c = _client(url, retries=8)  # the client waits Retry-After, then tries again
        rs = await asyncio.gather(*(c.completions.create(model=MODEL, prompt="a", max_tokens=10, seed=i)
                                    for i in range(24)))
        await c.close()
        return [r.choices[0].text for r in rs]

    assert all(len(t) == 10 for t in asyncio.run(patient()))


def test_client_disconnect_through_the_router_cancels_the_work_on_the_replica(ops):
    reps, url, token = ops
    with httpx.stream("POST", url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                      json={"model": MODEL, "prompt": "a", "max_tokens": 60, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one token, then hang up
    deadline = time.monotonic() + 5
    with httpx.Client(auth=ClusterTokenAuth(token), timeout=5) as h:
        while time.monotonic() < deadline:
            if all(h.get(rep.url + "/health").json()["batch_size"] == 0 for rep in reps):
                break
            time.sleep(0.05)
        # 60 tokens at 10x slowdown take seconds: an empty batch this soon means the slot was freed
        assert all(h.get(rep.url + "/health").json()["batch_size"] == 0 for rep in reps)


def test_hang_and_partition_from_a_fault_plan_cost_no_request_and_streams_stay_identical(ops, tmp_path):
    reps, url, token = ops
    seeds = list(range(6))
    reference = asyncio.run(_mixed(url, seeds))
    plan = tmp_path / "plan.toml"
    plan.write_text('[[fault]]\nkind = "hang"\nworker = 1\nat_s = 0.5\nfor_s = 3\n\n'
                    '[[fault]]\nkind = "partition"\nisolate = 2\nat_s = 0.5\nfor_s = 3\n')
    faults = load_serving_faults(plan, replicas=3)

    async def run() -> tuple[dict, list, float | None, float | None]:
        driver = asyncio.create_task(run_fault_plan(faults, reps, token))
        load = asyncio.create_task(_mixed(url, seeds))
        t_fault = time.monotonic() + 0.5
        out1 = out2 = None
        async with httpx.AsyncClient(timeout=5) as h:
            for _ in range(200):
                reps_h = (await h.get(url + "/health")).json()["replicas"]
                now = time.monotonic() - t_fault
                if out1 is None and not reps_h["r1"]["healthy"]:
                    out1 = now
                if out2 is None and not reps_h["r2"]["healthy"]:
                    out2 = now
                if out1 is not None and out2 is not None:
                    break
                await asyncio.sleep(0.02)
        return await load, await driver, out1, out2

    out, applied, hang_out_s, partition_out_s = asyncio.run(run())
    assert [a["kind"] for a in applied] == ["hang", "partition"]
    assert out == reference  # zero failed requests, streamed or not, byte for byte the fault-free text
    assert partition_out_s is not None and partition_out_s <= 1.0, partition_out_s
    # a hung replica is only noticed once it has work that does not move (progress rule)
    assert hang_out_s is not None and hang_out_s <= 2.0, hang_out_s
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (_healthy(url, "r1") and _healthy(url, "r2")):
        time.sleep(0.1)
    assert _healthy(url, "r1") and _healthy(url, "r2")  # both re-admitted once they proved healthy again


def test_a_killed_replica_with_restart_comes_back_on_its_port_and_is_readmitted_with_nothing_failed(ops, tmp_path):
    reps, url, token = ops
    seeds = list(range(6))
    reference = asyncio.run(_mixed(url, seeds))
    plan = tmp_path / "plan.toml"
    plan.write_text('[[fault]]\nkind = "kill"\nworker = 1\nat_s = 0.5\nrestart = true\n')
    faults = load_serving_faults(plan, replicas=3)
    old_pid = reps[1].proc.pid

    async def run() -> tuple[dict, list]:
        driver = asyncio.create_task(run_fault_plan(faults, reps, token))
        out = await _mixed(url, seeds)
        return out, await driver

    out, applied = asyncio.run(run())
    assert out == reference
    assert [a["kind"] for a in applied] == ["kill", "restart"] and reps[1].proc.pid != old_pid
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not _healthy(url, "r1"):
        time.sleep(0.1)
    assert _healthy(url, "r1")
    events = httpx.get(url + "/health", timeout=5).json()["events"]
    assert any(e.get("replica") == "r1" and e.get("healthy") is False for e in events)  # it really left


def test_sigterm_drains_the_replica_in_flight_work_finishes_and_nothing_fails(ops):
    reps, url, _ = ops
    seeds = list(range(6))
    reference = asyncio.run(_mixed(url, seeds))

    async def run() -> dict:
        load = asyncio.create_task(_mixed(url, seeds))
        await asyncio.sleep(0.5)
        reps[0].proc.send_signal(signal.SIGTERM)
        return await load

    assert asyncio.run(run()) == reference
    assert reps[0].proc.wait(30) == 0  # exited by itself, cleanly, once its work was done
    assert "PHALANX_REPLICA_DRAINED idle=True" in reps[0].proc.stdout.read()
    assert not _healthy(url, "r0")
    assert asyncio.run(_mixed(url, [99]))  # the others keep serving
