"""Splitting state buffers into bounded chunks and joining them back: torch-free, so a heal in the
simulator (numpy state) does not import torch."""

from __future__ import annotations

from phalanx.core.errors import StateCorrupt


def chunk_buffers(buffers: list[memoryview], chunk_bytes: int) -> list[memoryview]:
    """Split buffers into pieces of at most chunk_bytes (for bounded frames)."""
    out = []
    for b in buffers:
        b = b.cast("B") if b.format != "B" else b
        if b.nbytes == 0:
            out.append(b)
        for i in range(0, b.nbytes, chunk_bytes):
            out.append(b[i : i + chunk_bytes])
    return out


def join_chunks(chunks: list[memoryview], sizes: list[int]) -> list[memoryview]:
    """Reassemble the original buffers from chunks, given each buffer's size."""
    data = memoryview(b"".join(bytes(c) for c in chunks))
    if data.nbytes != sum(sizes):
        raise StateCorrupt(f"received {data.nbytes} bytes of state, expected {sum(sizes)}")
    out, pos = [], 0
    for n in sizes:
        out.append(data[pos : pos + n])
        pos += n
    return out
