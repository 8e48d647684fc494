"""An abandoned Gloo group is destroyed at once, off the caller's threads: kept (the old graveyard
held it 120 s), a group whose peer was SIGKILLed with a collective in flight could spin a
``gloo_tcp_loop`` thread at a full core in a survivor until it was destroyed. Its threads go to nice
19 at abandon (collectives/group_teardown.py): its destructor may wait seconds meanwhile."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from phalanx.collectives.process_group import RendezvousStore

_RANK = r"""
import asyncio, json, os, sys, time
import torch
from phalanx.collectives.process_group import TorchProcessGroupFactory
from phalanx.core.errors import CollectiveError

rank, address = int(sys.argv[1]), sys.argv[2]

def gloo_threads(prefixes=("gloo", "pt_gloo")):
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = open(f"/proc/self/task/{tid}/comm").read().strip()
            st = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if comm.startswith(prefixes):
            out[tid] = int(st[11]) + int(st[12])
    return out

async def main():
    factory = TorchProcessGroupFactory(address, b"t" * 32, run_id="abandon")
    group = await factory.create(3, rank, 3, 30.0)
    t = torch.ones(125_000)
    for _ in range(5):
        await group.allreduce_sum(t, 30.0)
    if rank == 2:
        print("parked", flush=True)  # the test SIGKILLs this rank while the others wait on it
        time.sleep(60)
    workers_with_group = len(gloo_threads(("pt_gloo",)))  # the group's own worker threads
    time.sleep(0.2)
    try:
        await group.allreduce_sum(t, 5.0)  # in flight when rank 2 dies
        failed = ""
    except CollectiveError as e:
        failed = str(e)
    known = {}
    for tid in group._threads:
        try:
            known[tid] = open(f"/proc/self/task/{tid}/comm").read().strip()
        except OSError:
            pass
    group.abandon()
    nice_after = []  # read at once: the destructor may end the threads any moment
    for tid in known:
        try:
            nice_after.append(os.getpriority(os.PRIO_PROCESS, tid))
        except OSError:
            pass
    await asyncio.sleep(1.0)
    before = gloo_threads()
    await asyncio.sleep(2.0)
    after = gloo_threads()
    cpu_s = sum(after[k] - before[k] for k in after if k in before) / os.sysconf("SC_CLK_TCK")
    print("RESULT " + json.dumps({"failed": failed, "workers_with_group": workers_with_group,
                                  "workers_after": len(gloo_threads(("pt_gloo",))), "gloo_cpu_s": cpu_s,
                                  "known": sorted(known.values()), "nice_after": nice_after,
                                  "own_nice": os.getpriority(os.PRIO_PROCESS, 0)}), flush=True)

asyncio.run(main())
os._exit(0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_group_abandoned_after_a_peer_was_killed_leaves_no_gloo_threads_behind() -> None:
    store = RendezvousStore("127.0.0.1")
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), store.address],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
    try:
        assert procs[2].stdout is not None
        line = procs[2].stdout.readline()
        assert line.strip() == "parked", procs[2].communicate(timeout=30)[1][-2000:]
        procs[2].send_signal(signal.SIGKILL)
        outs = [p.communicate(timeout=120) for p in procs[:2]]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p, (out, err) in zip(procs[:2], outs):
        assert p.returncode == 0, err[-2000:]
        r = json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:])
        assert r["failed"], "the collective with a dead peer must fail"
        assert r["workers_with_group"] >= 1
        assert r["workers_after"] == 0, r  # the group is destroyed (its worker threads gone), not held 120 s
        assert r["gloo_cpu_s"] < 0.5, r  # and none spins
        # its threads were known from its constructor, and went below everything at abandon
        assert "gloo_tcp_loop" in r["known"] and "pt_gloo_runloop" in r["known"], (r["known"], r["nice_after"])
        assert all(n == 19 for n in r["nice_after"]), r
        assert r["own_nice"] == 0, r  # the caller's own thread is left alone
