"""A Gloo collective waited for on the body's thread (``_TorchPending.wait_here``): in slices,
the GIL released, so the caller can stop between them; the loop's ``wait`` then finds it finished,
with the outcome (a sum, or the failure when a peer left) it would have had."""

from tests.collectives.two_ranks import run_two_ranks

# Rank 1 joins each all-reduce late (the first after 0.4 s; the second never: it exits).
# Rank 0 waits in 20 ms slices and reports how many ran out before the collective finished.
_RANKS = """
import asyncio, os, sys, time, torch
from phalanx.core.errors import CollectiveError
from phalanx.collectives.process_group import TorchProcessGroupFactory
rank, address = int(sys.argv[1]), sys.argv[2]
async def main():
    g = await TorchProcessGroupFactory(address, b"token", backend="gloo", run_id="run").create(1, rank, 2, 20.0)
    t = torch.ones(50_000) * (rank + 1)
    if rank == 1:
        await asyncio.sleep(0.4)
        await g.allreduce_sum(t, 10.0)
        print("sum", t[0].item(), flush=True)
        await asyncio.sleep(0.3)
        os._exit(0)  # never enters the second all-reduce
    p = g.start_allreduce_sum(t)
    t0, slices = time.monotonic(), 0
    while not p.wait_here(0.02):
        slices += 1
    print("slices", slices, "waited", round(time.monotonic() - t0, 3), flush=True)
    await p.wait(0.001)  # finished: no timer, no callback
    print("sum", t[0].item(), flush=True)
    p2 = g.start_allreduce_sum(torch.ones(50_000))
    t0 = time.monotonic()
    while not p2.wait_here(0.02):
        assert time.monotonic() - t0 < 15, "a peer that left must end the collective"
    try:
        await p2.wait(0.001)
        print("second: summed?!", flush=True)
    except CollectiveError as e:
        print("second failed:", str(e)[:60], flush=True)
asyncio.run(main())
os._exit(0)
"""


def test_a_gloo_collective_is_waited_for_in_slices_and_keeps_its_outcome():
    ranks = run_two_ranks(_RANKS, 90)
    assert [code for code, _, _ in ranks] == [0, 0], ranks
    out0, out1 = ranks[0][1], ranks[1][1]
    assert "sum 3.0" in out0 and "sum 3.0" in out1, ranks
    slices = int(out0.split("slices")[1].split()[0])
    assert slices >= 5, out0  # rank 1 came 0.4 s late: many 20 ms slices ran out first
    assert "second failed: all-reduce failed in quorum 1" in out0, ranks
