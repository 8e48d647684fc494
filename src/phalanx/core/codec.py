"""Frame codec: a msgpack header (a tagged msgspec Struct) plus raw buffers. Never pickle.

Frame on the wire::

    u32 body_len | 32-byte HMAC | body
    body = u32 header_len | u32 n_buffers | u64 size * n_buffers | header | buffer...

Raw buffers (tensor bytes for healing) are sent as they are, with no copy into the header.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import msgspec

from phalanx.core.errors import FrameRejected, ProtocolVersionError
from phalanx.core.messages import Message

LEN = struct.Struct(">I")
BODY_PREFIX = struct.Struct(">II")
SIZE = struct.Struct(">Q")
MAX_BUFFERS = 4096

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode_body(message: Any, buffers: Sequence[bytes | bytearray | memoryview] = ()) -> list[bytes | memoryview]:
    """Return the body parts of one frame (without length and MAC)."""
    header = _encoder.encode(message)
    views = [memoryview(b).cast("B") for b in buffers]
    if len(views) > MAX_BUFFERS:
        raise ValueError(f"{len(views)} buffers in one frame; at most {MAX_BUFFERS}")
    prefix = BODY_PREFIX.pack(len(header), len(views)) + b"".join(SIZE.pack(v.nbytes) for v in views)
    return [prefix, header, *views]


def body_length(parts: Sequence[bytes | memoryview]) -> int:
    return sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)


def decode_body(body: memoryview) -> tuple[Any, list[memoryview]]:
    """Decode a verified frame body. Raises FrameRejected naming what is malformed."""
    if body.nbytes < BODY_PREFIX.size:
        raise FrameRejected(f"frame body of {body.nbytes} bytes is shorter than its prefix")
    header_len, n_buffers = BODY_PREFIX.unpack_from(body, 0)
    if n_buffers > MAX_BUFFERS:
        raise FrameRejected(f"frame declares {n_buffers} buffers; at most {MAX_BUFFERS}")
    pos = BODY_PREFIX.size
    sizes_end = pos + SIZE.size * n_buffers
    if sizes_end + header_len > body.nbytes:
        raise FrameRejected("frame header runs past the end of the frame")
    sizes = [SIZE.unpack_from(body, pos + SIZE.size * i)[0] for i in range(n_buffers)]
    header = body[sizes_end : sizes_end + header_len]
    pos = sizes_end + header_len
    if pos + sum(sizes) != body.nbytes:
        raise FrameRejected(f"frame buffers total {sum(sizes)} bytes but {body.nbytes - pos} remain")
    try:
        message = _decoder.decode(header)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise FrameRejected(f"undecodable message header: {e}") from e
    buffers = []
    for size in sizes:
        buffers.append(body[pos : pos + size])
        pos += size
    return message, buffers


def check_version(peer_version: int, ours: int) -> None:
    if peer_version != ours:
        raise ProtocolVersionError(
            f"protocol version mismatch: peer speaks {peer_version}, this build speaks {ours}; "
            "run the same phalanx version on every machine"
        )


def encoded_size(message: Any, buffers: Sequence[bytes | bytearray | memoryview] = ()) -> int:
    """Bytes this message occupies on the wire (used by the simulator to charge bandwidth)."""
    return LEN.size + 32 + body_length(encode_body(message, buffers))
