"""Rendezvous values are signed with the cluster key and bound to the job and the quorum: a party
that can reach the TCPStore but lacks the token cannot inject a peer into a process group."""

import subprocess
import sys

import pytest
import torch.distributed as dist

from phalanx.collectives.signed_store import signed_store
from tests.collectives.two_ranks import run_two_ranks


def test_a_signed_value_reads_back_and_a_forged_or_foreign_one_is_refused():
    inner = dist.HashStore()
    store = signed_store(inner, b"token", "run-a")
    store.set("ns/q3/rank_0", b"10.0.0.1:4000")
    assert store.get("ns/q3/rank_0") == b"10.0.0.1:4000"
    inner.set("ns/q3/rank_1", b"attacker:6666")  # written by someone without the token
    with pytest.raises(RuntimeError, match="not signed with this job's cluster key"):
        store.get("ns/q3/rank_1")
    other_job = signed_store(inner, b"token", "run-b")  # same token, another run
    other_job.set("ns/q3/rank_2", b"x")
    with pytest.raises(RuntimeError, match="not signed"):
        store.get("ns/q3/rank_2")
    inner.set("ns/q4/rank_0", inner.get("ns/q3/rank_0"))  # a valid value replayed under another quorum
    with pytest.raises(RuntimeError, match="not signed"):
        store.get("ns/q4/rank_0")


# Ends with os._exit, as bench/ddp_worker.py does: a bare ProcessGroupGloo alive at interpreter
# teardown sometimes aborts there ("terminate called without an active exception", exit -6) after
# the all-reduce has succeeded; what this test checks is the rendezvous and the sum.
_WORKER = """
import datetime, os, sys, torch, torch.distributed as dist
from phalanx.collectives.signed_store import signed_store
rank, port = int(sys.argv[1]), int(sys.argv[2])
inner = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
signed = signed_store(inner, b"token", "run")
pg = dist.ProcessGroupGloo(dist.PrefixStore("q1", signed), rank, 2, datetime.timedelta(seconds=30))
t = torch.ones(3) * (rank + 1)
pg.allreduce([t]).wait()
print(t.tolist(), flush=True)
os._exit(0)
"""


def test_gloo_forms_a_group_through_the_signed_store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(r), str(master.port)], stdout=subprocess.PIPE,
                              text=True) for r in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert all("[3.0, 3.0, 3.0]" in o for o in outs)


# Rank 0 starts building quorum 1's group, whose rank 1 never arrives (a member that hangs in the
# middle of the rendezvous, as a GIL hang does), then builds quorum 2's with a live peer.
_STUCK_THEN_NEXT = """
import asyncio, os, sys, time, torch
from phalanx.collectives.process_group import TorchProcessGroupFactory
rank, address = int(sys.argv[1]), sys.argv[2]
async def main():
    f = TorchProcessGroupFactory(address, b"token", backend="gloo", run_id="run")
    if rank == 0:
        stuck = asyncio.ensure_future(f.create(1, 0, 2, 20.0))
        await asyncio.sleep(1.0)  # its rendezvous is waiting in the store for rank 1 by now
        assert not stuck.done()
    t0 = time.monotonic()
    g = await f.create(2, rank, 2, 20.0)
    print("built_s", time.monotonic() - t0, flush=True)
    t = torch.ones(3) * (rank + 1)
    await g.allreduce_sum(t, 10.0)
    print(t.tolist(), flush=True)
asyncio.run(main())
os._exit(0)
"""


def test_a_group_build_stuck_on_a_hung_member_does_not_hold_up_the_next_quorums():
    ranks = run_two_ranks(_STUCK_THEN_NEXT, 60)
    outs = [out for _, out, _ in ranks]
    assert [code for code, _, _ in ranks] == [0, 0], ranks
    assert all("[3.0, 3.0, 3.0]" in o for o in outs), outs
    built = float(outs[0].split("built_s")[1].split()[0])
    # on a store connection shared with the stuck build it waited for that build's 20 s deadline
    assert built < 10.0, outs
