"""A joiner's load of a healed state runs to its end even when the quorum breaks meanwhile, and
only then is the source acked. A load cancelled half way would go on in its thread (the real
TrainingState copies into the model off the event loop) while the engine moved on to heal again:
two loads racing into one model."""

from __future__ import annotations

import asyncio
import hashlib

from phalanx.core.messages import HealAck, HealChunk, HealOffer, HealRequest
from phalanx.train.assignment import Assignment, WorkerConfig
from phalanx.train.worker_agent import WorkerAgent
from phalanx.transport.real_host import RealHost

STATE = b"abcdefgh"


class _Conn:
    def __init__(self) -> None:
        self.sent: list[object] = []
        self.closed = False
        self._incoming = [
            (HealOffer(quorum_id=5, step=3, state_header=b"{}", buffer_sizes=[len(STATE)], chunk_count=1,
                       checksum=hashlib.sha256(STATE).hexdigest()), []),
            (HealChunk(index=0), [memoryview(STATE)]),
        ]

    async def send(self, message, buffers=()):  # type: ignore[no-untyped-def]
        self.sent.append(message)

    async def recv(self):  # type: ignore[no-untyped-def]
        return self._incoming.pop(0)

    def close(self, reason: str = "closed") -> None:
        self.closed = True


class _Transport:
    def __init__(self) -> None:
        self.conn = _Conn()

    async def connect(self, address: str, timeout_s: float) -> _Conn:
        return self.conn


def test_a_quorum_broken_during_the_load_waits_for_the_load_then_acks() -> None:
    async def main() -> tuple[list[str], _Conn, object]:
        transport = _Transport()
        agent = WorkerAgent(RealHost("w1", transport=transport), WorkerConfig("w1", "c:1"), pg_factory=None)  # type: ignore[arg-type]
        a = Assignment(3, 5, ("w0", "w1"), 1, "w0", "w0:1", (), "", False)
        started, release, log = asyncio.Event(), asyncio.Event(), []

        async def load(healed) -> None:  # type: ignore[no-untyped-def]
            assert bytes(healed.buffers[0]) == STATE
            started.set()
            try:
                await release.wait()
                log.append("loaded")
            except asyncio.CancelledError:
                log.append("cancelled half way")
                raise

        task = asyncio.create_task(agent.heal(a, load))
        await asyncio.wait_for(started.wait(), 5)
        agent._quorum_broken(5, "w0 lost")  # as the coordinator's QuorumBroken does
        await asyncio.sleep(0.05)
        assert not task.done()  # still loading
        release.set()
        result = await asyncio.wait_for(task, 5)
        return log, transport.conn, result

    log, conn, healed = asyncio.run(main())
    assert log == ["loaded"]
    assert isinstance(conn.sent[0], HealRequest)
    ack = conn.sent[-1]
    assert isinstance(ack, HealAck) and ack.ok and ack.checksum == healed.checksum  # type: ignore[attr-defined]
    assert conn.closed
