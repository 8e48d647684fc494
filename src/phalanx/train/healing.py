"""Healing, the worker's side: fetch the live state from a peer, or serve ours to peers.

Fenced by the quorum id: a heal request for any other epoch is refused, and the receiver checks
the SHA-256 of what it got (echoed to the sender in HealAck). Mixed into
:class:`phalanx.train.worker_agent.WorkerAgent`, whose connection and assignments it uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from dataclasses import dataclass
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from phalanx.core.codec import MAX_BUFFERS
from phalanx.core.errors import HealError, QuorumBroken, StaleEpoch, TransportError
from phalanx.core.host import Connection
from phalanx.core.messages import HealAck, HealChunk, HealDone, HealOffer, HealRequest, Refused

if TYPE_CHECKING:
    from phalanx.core.host import Host
    from phalanx.train.worker_agent import Assignment, WorkerConfig


@dataclass(frozen=True)
class HealedState:
    header: bytes
    buffers: list[memoryview]
    checksum: str
    source: str


class Healing:
    # provided by WorkerAgent
    host: "Host"
    cfg: "WorkerConfig"
    state_provider: Callable[[], tuple[bytes, list[memoryview]]] | None
    last_committed_step: int
    has_state: bool
    _serving: "Assignment | None"
    _snapshot: tuple[int, bytes, list[memoryview], str] | None
    _capture_lock: asyncio.Lock
    _heal_acks: dict[str, asyncio.Future[bool]]
    _race_broken: Callable[..., Awaitable[Any]]
    _send: Callable[[Any], Awaitable[None]]
    # ---- healing: fetching ----
    async def heal(self, a: Assignment, load: Callable[[HealedState], Awaitable[None]]) -> HealedState:
        """Copy the live state from ``a.heal_from`` (fenced by the quorum id) and ``load`` it.

        The acknowledgement goes back to the source only once the state is loaded: the source
        opens the quorum's process group when every target has acked, and the group's deadline
        must not run while a target still decodes and copies its state (three joiners loading
        300 MB each at once on two cores outlasted the 5 s group deadline, and everyone healed
        again). The load itself is neither raced against the quorum breaking nor timed: a load
        cancelled half way would go on in its thread while the engine moved on to the next heal."""
        try:
            conn, healed = await asyncio.wait_for(self._race_broken(a, self._fetch(a)), self.cfg.heal_timeout_s)
        except (TransportError, asyncio.TimeoutError) as e:
            raise HealError(f"healing from {a.heal_from} failed: {e or 'timed out'}") from e
        try:
            loaded = False
            try:
                await load(healed)
                loaded = True
            finally:  # best effort: a source that is gone has nothing left to learn from it
                with contextlib.suppress(TransportError, asyncio.TimeoutError):
                    await asyncio.wait_for(conn.send(HealAck(quorum_id=a.quorum_id, checksum=healed.checksum,
                                                             ok=loaded)), self.cfg.connect_timeout_s)
        finally:
            conn.close()
        return healed

    async def _fetch(self, a: Assignment) -> tuple[Connection, HealedState]:
        """The state's bytes, checked against the source's SHA-256; the connection stays open for
        the acknowledgement (closed here only on failure)."""
        conn = await self.host.transport.connect(a.heal_address, self.cfg.connect_timeout_s)
        try:
            await conn.send(HealRequest(worker_id=self.cfg.worker_id, quorum_id=a.quorum_id, step=a.step))
            offer, _ = await conn.recv()
            if isinstance(offer, Refused):
                raise StaleEpoch(f"{a.heal_from} refused to heal us: {offer.reason}")
            if not isinstance(offer, HealOffer) or offer.quorum_id != a.quorum_id:
                raise HealError(f"{a.heal_from} sent {type(offer).__name__} for the wrong epoch")
            chunks: list[memoryview] = []
            digest = hashlib.sha256()
            for i in range(offer.chunk_count):
                chunk_msg, bufs = await conn.recv()
                if not isinstance(chunk_msg, HealChunk) or chunk_msg.index != i:
                    raise HealError(f"{a.heal_from} sent {type(chunk_msg).__name__} where heal chunk {i} belongs")
                for b in bufs:
                    digest.update(b)
                    chunks.append(b)
            checksum = digest.hexdigest()
            if checksum != offer.checksum:
                await conn.send(HealAck(quorum_id=a.quorum_id, checksum=checksum, ok=False))
                raise HealError(f"state from {a.heal_from} failed its checksum ({checksum[:12]} != {offer.checksum[:12]})")
            from phalanx.checkpoint.chunks import join_chunks
            buffers = await self.host.run_blocking(lambda: join_chunks(chunks, list(offer.buffer_sizes)))
            return conn, HealedState(offer.state_header, buffers, checksum, a.heal_from)
        except BaseException:
            conn.close()
            raise

    async def heal_done(self, a: Assignment, checksum: str) -> None:
        self.last_committed_step, self.has_state = a.step - 1, True
        await self._send(HealDone(step=a.step, quorum_id=a.quorum_id, checksum=checksum, source=a.heal_from))

    # ---- healing: serving ----
    async def serve_heals(self, a: Assignment) -> None:
        """Serve our committed state to a's heal targets; returns once each acked or was lost."""
        self._serving = a
        self._snapshot = None
        loop = asyncio.get_running_loop()
        for t in a.heal_targets:
            self._heal_acks.setdefault(t, loop.create_future())
        waits = [self._heal_acks[t] for t in a.heal_targets]
        try:
            await self._race_broken(a, asyncio.wait_for(asyncio.gather(*waits), self.cfg.heal_timeout_s))
        except (asyncio.TimeoutError, QuorumBroken):
            pass  # the coordinator notices a lost target and re-forms the quorum
        finally:
            for t in a.heal_targets:
                self._heal_acks.pop(t, None)
            self._serving, self._snapshot = None, None

    async def _serve_heal(self, conn: Connection) -> None:
        try:
            req, _ = await conn.recv()
            if not isinstance(req, HealRequest):
                return
            a = await self._wait_serving(req)
            if a is None:
                await conn.send(Refused(reason=f"not serving quorum {req.quorum_id} (stale epoch)"))
                return
            step_, header, buffers, checksum = await self._captured(a)
            chunk_bytes = self.cfg.heal_chunk_bytes
            from phalanx.checkpoint.chunks import chunk_buffers
            chunks = chunk_buffers(buffers, chunk_bytes)
            frames = frames_of(chunks, chunk_bytes, MAX_BUFFERS)
            await conn.send(HealOffer(quorum_id=a.quorum_id, step=a.step, state_header=header,
                                      buffer_sizes=[b.nbytes for b in buffers], chunk_count=len(frames),
                                      checksum=checksum))
            for i, frame in enumerate(frames):
                await conn.send(HealChunk(index=i), frame)
            ack, _ = await conn.recv()
            ok = isinstance(ack, HealAck) and ack.ok and ack.checksum == checksum
            fut = self._heal_acks.get(req.worker_id)
            if fut is not None and not fut.done():
                fut.set_result(ok)
        except TransportError:
            pass
        finally:
            conn.close()

    async def _wait_serving(self, req: HealRequest) -> Assignment | None:
        """The joiner may ask a moment before our own assignment arrives; wait briefly for it."""
        for _ in range(200):
            a = self._serving
            if a is not None and a.quorum_id == req.quorum_id and req.worker_id in a.heal_targets:
                return a
            if a is not None and a.quorum_id > req.quorum_id:
                return None
            await self.host.sleep(0.01)
        return None

    async def _captured(self, a: Assignment) -> tuple[int, bytes, list[memoryview], str]:
        """The quorum's snapshot, taken once for all its joiners (the lock makes the others wait
        for it). The copy and hash of the whole state (300 MB for 25 M parameters with Adam: ~1 s
        on a busy core) run off the event loop: on it, they silenced this worker's heartbeats past
        the timeout, and the healer was suspected in turn (a fault-free run's cascade)."""
        async with self._capture_lock:
            if self._snapshot is None or self._snapshot[0] != a.quorum_id:
                self._snapshot = await self.host.run_blocking(lambda: self._capture(a.quorum_id))
            return self._snapshot

    def _capture(self, quorum_id: int) -> tuple[int, bytes, list[memoryview], str]:
        """The provider's snapshot and its SHA-256 (hashed here only if the provider has none: a
        real worker's encoder already hashed these very buffers, 0.2-0.4 s at 300 MB)."""
        assert self.state_provider is not None, "a heal source needs a state provider"
        header, buffers, checksum = self.state_provider()
        if not checksum:
            digest = hashlib.sha256()
            for b in buffers:
                digest.update(b)
            checksum = digest.hexdigest()
        return quorum_id, header, buffers, checksum


def frames_of(chunks: list[memoryview], frame_bytes: int, buffers_max: int) -> list[list[memoryview]]:
    """Group a state's chunks into frames of at most ``frame_bytes`` bytes and ``buffers_max``
    buffers each (the codec's limit per frame): a model of any number of tensors heals."""
    frames: list[list[memoryview]] = []
    size = frame_bytes + 1
    for c in chunks:
        if size + c.nbytes > frame_bytes or len(frames[-1]) >= buffers_max:
            frames.append([])
            size = 0
        frames[-1].append(c)
        size += c.nbytes
    return frames
