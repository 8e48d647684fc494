"""A heal source copies and hashes its whole state off the event loop (Host.run_blocking): on the
loop, a 300 MB state (25 M parameters with Adam) held it ~1 s, the worker's heartbeats stopped past
their timeout, and a fault-free run's healer was suspected in turn (session 15, mlp-25m, 4 workers)."""

from __future__ import annotations

import asyncio
import time

from phalanx.core.messages import HealAck, HealRequest
from phalanx.train.assignment import Assignment, WorkerConfig
from phalanx.train.worker_agent import WorkerAgent
from phalanx.transport.real_host import RealHost


class _Conn:
    def __init__(self) -> None:
        self.sent: list[object] = []
        self._incoming = [(HealRequest(worker_id="w1", quorum_id=5, step=3), [])]

    async def recv(self):  # the request, then the ack once the state went out
        if self._incoming:
            return self._incoming.pop(0)
        return HealAck(quorum_id=5, checksum=self.sent[0].checksum, ok=True), []  # type: ignore[attr-defined]

    async def send(self, message, buffers=()):
        self.sent.append(message)

    def close(self, reason: str = "closed") -> None:
        pass


def test_serving_a_heal_leaves_the_event_loop_free_while_the_state_is_captured() -> None:
    def slow_state():  # what capture_training_state + encoding cost a large model, on this thread
        time.sleep(0.8)
        return b"{}", [memoryview(b"x" * 1024)], ""

    async def main() -> tuple[float, list[object]]:
        agent = WorkerAgent(RealHost("w0", transport=None), WorkerConfig("w0", "c:1"), pg_factory=None,  # type: ignore[arg-type]
                            state_provider=slow_state)
        agent._serving = Assignment(3, 5, ("w0", "w1"), 0, "", "", ("w1",), "", False)
        gap = [0.0]

        async def ticker() -> None:  # what the heartbeat loop needs: the loop, every few ms
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gap[0], last = max(gap[0], now - last), now

        t = asyncio.get_running_loop().create_task(ticker())
        await asyncio.sleep(0.05)  # the ticker is running before the heal is served
        conn = _Conn()
        await agent._serve_heal(conn)  # type: ignore[arg-type]
        await asyncio.sleep(0.05)  # the ticker wakes once more and measures any stall
        t.cancel()
        return gap[0], conn.sent

    gap_s, sent = asyncio.run(main())
    assert [type(m).__name__ for m in sent[:2]] == ["HealOffer", "HealChunk"]  # the state went out
    assert gap_s < 0.4, f"the event loop stalled {gap_s:.2f} s while the state was captured"
