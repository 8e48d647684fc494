"""The real host's clock has sub-millisecond resolution and advances inside one callback, on
uvloop too (whose loop.time() is libuv's whole milliseconds, read once per loop iteration): the
coordinator's commit records and the benchmark's step times are read from it."""

from __future__ import annotations

import time

import pytest

from phalanx.core import event_loop
from phalanx.transport.real_host import RealHost


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_the_host_clock_advances_within_one_callback_at_sub_millisecond_resolution(kind):
    pytest.importorskip(kind)

    async def main() -> list[float]:
        host = RealHost("w0", transport=None)  # type: ignore[arg-type]
        readings = [host.now()]
        for _ in range(5):  # 0.3 ms of busy work between readings, no await
            until = time.perf_counter() + 0.0003
            while time.perf_counter() < until:
                pass
            readings.append(host.now())
        return readings

    r = event_loop.run(main(), kind)
    gaps = [b - a for a, b in zip(r, r[1:])]
    assert all(g >= 0.0003 for g in gaps), gaps  # a cached loop clock would read 0 here
    assert any(abs(g * 1000 - round(g * 1000)) > 1e-6 for g in gaps), gaps  # not whole milliseconds
