"""`phalanx serve replica --join`: a replica started on its own registers with a running router (signed with
the cluster token), is admitted once healthy and receives traffic."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai

from phalanx.serve.cluster import spawn_replicas, spawn_router, stop_replicas

MODEL = "phalanx-charlm"


def test_a_replica_joins_a_running_router_and_receives_traffic(token_file, tmp_path):
    reps = spawn_replicas(1, ["--random-weights", "0"], token_file)
    router = spawn_router({r.replica_id: r.url for r in reps}, token_file)
    joiner = None
    try:
        refused = httpx.post(router.url + "/phalanx/join", json={"replica_id": "x", "url": "http://127.0.0.1:1"},
                             timeout=5)
        assert refused.status_code == 401  # joining needs the cluster token
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        joiner = subprocess.Popen([sys.executable, "-m", "phalanx.cli.main", "serve", "replica", "--join",
                                   router.url.removeprefix("http://"), "--token-file", str(token_file),
                                   "--random-weights", "1", "--replica-id", "second"],
                                  stdout=subprocess.PIPE, text=True, env=env)
        assert joiner.stdout is not None
        lines = []
        for _ in range(200):  # bounded: the replica prints a few lines, then JOINED
            line = joiner.stdout.readline()
            lines.append(line)
            if line.startswith("PHALANX_REPLICA_JOINED") or not line:
                break
        assert lines[-1].startswith("PHALANX_REPLICA_JOINED second"), lines
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # admitted once its health polls succeed
            h = httpx.get(router.url + "/health", timeout=5).json()["replicas"]
            if h.get("second", {}).get("healthy"):
                break
            time.sleep(0.1)
        assert h["second"]["healthy"] and h["second"]["url"].startswith("http://127.0.0.1:")  # loopback by default
        c = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=30)
        served_by = {c.completions.create(model=MODEL, prompt="The ", max_tokens=2, seed=i).system_fingerprint
                     for i in range(30)}
        assert served_by == {"random-0", "random-1"}  # the joined replica (untrained seed 1) takes traffic
    finally:
        if joiner is not None:
            joiner.kill()
            joiner.wait(10)
            if joiner.stdout is not None:
                joiner.stdout.close()
        router.stop()
        stop_replicas(reps)
