"""FrameStream: frames cut from a byte stream however it is split, limits held as bytes arrive."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.core.codec import LEN
from phalanx.core.errors import FrameRejected
from phalanx.transport.frames import HEAD, QUEUED_BYTES_MAX, FrameStream, StreamClosed


class _Transport:
    """What FrameStream asks of a transport, recorded."""

    def __init__(self) -> None:
        self.paused = False
        self.closed = False
        self.written: list[bytes] = []

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def writelines(self, parts) -> None:
        self.written.append(b"".join(bytes(p) for p in parts))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str):
        return None


def _frame(mac: bytes, body: bytes) -> bytes:
    return LEN.pack(len(body)) + mac + body


def _stream(limit: int = 1 << 16) -> tuple[FrameStream, _Transport]:
    s, t = FrameStream(limit), _Transport()
    s.connection_made(t)
    return s, t


async def _drain(s: FrameStream, n: int) -> list[tuple[bytes, bytes]]:
    return [await s.next_frame() for _ in range(n)]


@settings(max_examples=150, deadline=None)
@given(bodies=st.lists(st.binary(max_size=300), min_size=1, max_size=8),
       cuts=st.lists(st.integers(min_value=1, max_value=50), max_size=40))
def test_frames_come_out_whole_and_in_order_however_the_bytes_are_split(bodies, cuts):
    frames = [(bytes([i]) * 32, b) for i, b in enumerate(bodies)]
    wire = b"".join(_frame(m, b) for m, b in frames)
    s, _ = _stream()
    pos = 0
    for c in cuts:  # arbitrary read sizes, then the rest in one read
        s.data_received(wire[pos:pos + c])
        pos += c
    if pos < len(wire):
        s.data_received(wire[pos:])
    assert asyncio.run(_drain(s, len(frames))) == frames


def test_a_frame_whose_length_exceeds_the_limit_is_refused_before_its_body_arrives():
    s, _ = _stream(limit=100)
    s.data_received(_frame(b"m" * 32, b"ok"))
    s.data_received(LEN.pack(101) + b"m" * 32)  # only the head: refused already
    assert asyncio.run(_drain(s, 1)) == [(b"m" * 32, b"ok")]  # what came before is still delivered
    with pytest.raises(FrameRejected, match="exceeds the limit of 100"):
        asyncio.run(s.next_frame())


def test_the_peer_closing_mid_frame_ends_the_stream_after_the_whole_frames():
    s, _ = _stream()
    wire = _frame(b"a" * 32, b"one") + _frame(b"b" * 32, b"two")
    s.data_received(wire[:-1])
    s.eof_received()
    assert asyncio.run(_drain(s, 1)) == [(b"a" * 32, b"one")]
    with pytest.raises(StreamClosed, match="partial"):
        asyncio.run(s.next_frame())


def test_a_flood_nobody_reads_pauses_reading_and_taking_frames_resumes_it():
    s, t = _stream(limit=1 << 20)
    body = b"x" * 65536
    n = QUEUED_BYTES_MAX // len(body) + 2
    for _ in range(n):
        s.data_received(_frame(b"m" * 32, body))
    assert t.paused
    asyncio.run(_drain(s, n))
    assert not t.paused


def test_a_waiting_reader_wakes_when_its_frame_completes_and_when_the_peer_goes():
    async def main():
        s, _ = _stream()
        waiting = asyncio.ensure_future(s.next_frame())
        await asyncio.sleep(0)
        wire = _frame(b"m" * 32, b"hello")
        s.data_received(wire[:HEAD + 2])
        await asyncio.sleep(0)
        assert not waiting.done()
        s.data_received(wire[HEAD + 2:])
        assert await waiting == (b"m" * 32, b"hello")
        waiting = asyncio.ensure_future(s.next_frame())
        await asyncio.sleep(0)
        s.connection_lost(None)
        with pytest.raises(StreamClosed):
            await waiting
    asyncio.run(main())
