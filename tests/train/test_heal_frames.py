"""A state of any number of tensors heals: frames are bounded by bytes and by the codec's
buffer count, and such a state crosses a real authenticated TCP connection intact."""

import asyncio
import hashlib

import numpy as np

from phalanx.checkpoint.state_codec import chunk_buffers, join_chunks
from phalanx.core.codec import MAX_BUFFERS
from phalanx.core.errors import TransportError
from phalanx.core.messages import HealChunk
from phalanx.train.healing import frames_of
from phalanx.transport.tcp import TcpTransport

TOKEN = b"h" * 32


def _state(n_tensors=10_000):
    rng = np.random.default_rng(0)
    return [memoryview(rng.standard_normal(rng.integers(1, 40)).astype(np.float32).tobytes()) for _ in range(n_tensors)]


def test_frames_respect_both_bounds():
    bufs = _state()
    frames = frames_of(chunk_buffers(bufs, 1 << 20), 1 << 24, MAX_BUFFERS)
    assert len(frames) >= 3 and all(len(f) <= MAX_BUFFERS for f in frames)
    assert all(sum(c.nbytes for c in f) <= 1 << 24 for f in frames)


def test_a_ten_thousand_tensor_state_crosses_real_tcp_intact():
    bufs = _state()
    sizes = [b.nbytes for b in bufs]
    digest = hashlib.sha256(b"".join(bytes(b) for b in bufs)).hexdigest()

    async def main():
        got = []
        done = asyncio.get_running_loop().create_future()

        async def receiver(conn):
            try:
                while True:
                    m, frame = await conn.recv()
                    got.extend(bytes(c) for c in frame)
                    if m.index == n_frames - 1:
                        done.set_result(None)
            except TransportError:
                pass

        listener = await TcpTransport(TOKEN).listen("127.0.0.1:0", receiver)
        conn = await TcpTransport(TOKEN).connect(listener.address, 5)
        frames = frames_of(chunk_buffers(bufs, 1 << 20), 1 << 24, MAX_BUFFERS)
        n_frames = len(frames)
        for i, frame in enumerate(frames):
            await conn.send(HealChunk(index=i), frame)
        await asyncio.wait_for(done, 20)
        return got

    chunks = asyncio.run(main())
    out = join_chunks([memoryview(c) for c in chunks], sizes)
    assert hashlib.sha256(b"".join(bytes(b) for b in out)).hexdigest() == digest
