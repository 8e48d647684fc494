"""A Gloo collective waited for on the body's thread (``_TorchPending.wait_here``): in slices,
the GIL released, so the caller can stop between them; the collective's completion ends a slice at
once, and so does ``wake`` (the control loop's, when the step is lost); the loop's ``wait`` then
finds it finished, with the outcome (a sum, or the failure when a peer left) it would have had."""

from tests.collectives.two_ranks import run_two_ranks

# Rank 1 joins each all-reduce late (0.4 s, 0.4 s, 1.0 s; the fourth never: it exits).
_RANKS = """
import asyncio, os, sys, threading, time, torch
from phalanx.core.errors import CollectiveError
from phalanx.collectives.process_group import TorchProcessGroupFactory
rank, address = int(sys.argv[1]), sys.argv[2]
async def main():
    g = await TorchProcessGroupFactory(address, b"token", backend="gloo", run_id="run").create(1, rank, 2, 20.0)
    t = torch.ones(50_000) * (rank + 1)
    if rank == 1:
        for late_s in (0.4, 0.4, 1.0):
            await asyncio.sleep(late_s)
            await g.allreduce_sum(t, 10.0)
            print("sum", t[0].item(), flush=True)
        await asyncio.sleep(0.3)
        os._exit(0)  # never enters the fourth all-reduce
    # 1: short slices run out while rank 1 is late
    p = g.start_allreduce_sum(t)
    t0, slices = time.monotonic(), 0
    while not p.wait_here(0.02):
        slices += 1
    print("slices", slices, "waited", round(time.monotonic() - t0, 3), flush=True)
    await p.wait(0.001)  # finished: no timer, no callback
    print("sum", t[0].item(), flush=True)
    # 2: one long slice ends when the collective completes, not when the slice runs out
    p = g.start_allreduce_sum(t)
    t0 = time.monotonic()
    done = p.wait_here(10.0)
    print("long", done, round(time.monotonic() - t0, 3), flush=True)
    await p.wait(0.001)
    # 3: a wake from another thread ends a long slice; the collective still completes after it
    p = g.start_allreduce_sum(t)
    threading.Timer(0.1, p.wake).start()
    t0 = time.monotonic()
    done = p.wait_here(10.0)
    print("woken", done, round(time.monotonic() - t0, 3), flush=True)
    while not p.wait_here(0.02):
        pass
    await p.wait(0.001)
    print("after wake sum", t[0].item(), flush=True)
    # 4: a peer that left ends the collective
    p2 = g.start_allreduce_sum(torch.ones(50_000))
    t0 = time.monotonic()
    while not p2.wait_here(0.02):
        assert time.monotonic() - t0 < 15, "a peer that left must end the collective"
    try:
        await p2.wait(0.001)
        print("fourth: summed?!", flush=True)
    except CollectiveError as e:
        print("fourth failed:", str(e)[:60], flush=True)
asyncio.run(main())
os._exit(0)
"""


def test_a_gloo_collective_is_waited_for_in_slices_woken_by_its_end_or_a_wake():
    ranks = run_two_ranks(_RANKS, 90)
    assert [code for code, _, _ in ranks] == [0, 0], ranks
    out0, out1 = ranks[0][1], ranks[1][1]
    assert "sum 3.0" in out0 and "sum 3.0" in out1, ranks
    slices = int(out0.split("slices")[1].split()[0])
    assert slices >= 5, out0  # rank 1 came 0.4 s late: many 20 ms slices ran out first
    long_done, long_s = out0.split("long ")[1].split()[:2]
    assert long_done == "True" and 0.2 < float(long_s) < 5.0, out0  # the end of the sum, not of the slice
    woken_done, woken_s = out0.split("woken ")[1].split()[:2]
    assert woken_done == "False" and float(woken_s) < 0.8, out0  # the wake, before rank 1 joined at 1.0 s
    assert "after wake sum 12.0" in out0, out0  # 3 -> 6 -> 12: every sum landed
    assert "fourth failed: all-reduce failed in quorum 1" in out0, ranks
