"""The frame codec and every message type: random bytes, mutated valid frames, truncations and
huge lengths decode to a message or raise FrameRejected; nothing else ever escapes."""

import struct

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from phalanx.core import messages as M
from phalanx.core.codec import BODY_PREFIX, decode_body, encode_body
from phalanx.core.errors import FrameRejected

TYPES = [t for t in M.Message.__args__]  # every message kind on the wire


def _valid(t):
    """A strategy of valid instances of message type t (msgspec's own constraints included)."""
    return st.builds(t) if not msgspec.structs.fields(t) else st.from_type(t)


def _decode(body: bytes):
    try:
        return decode_body(memoryview(body))
    except FrameRejected:
        return None


@given(st.binary(max_size=4096))
def test_random_bytes_decode_or_are_rejected(body):
    _decode(body)


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=40) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)


@given(st.sampled_from(TYPES), st.data())
def test_every_message_type_with_any_field_values_decodes_or_is_rejected(t, data):
    names = [f.name for f in msgspec.structs.fields(t)]
    fields = {n: data.draw(_VALUES) for n in names if data.draw(st.booleans())}
    raw = msgspec.msgpack.encode({"type": t.__name__, **fields})
    got = _decode(BODY_PREFIX.pack(len(raw), 0) + raw)
    if got is not None:
        assert type(got[0]) is t  # whatever decodes is exactly the kind it claims, fully validated


@given(st.sampled_from([M.Heartbeat(seq=3, step=7), M.Goodbye(completed=True, reason="x", final_step=9),
                        M.QuorumAssigned(step=1, quorum_id=2, members=["w0", "w1"], rank=0)]),
       st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=8), st.integers(0, 300))
def test_mutated_and_truncated_frames_are_rejected_not_crashed(msg, flips, cut):
    body = bytearray(b"".join(bytes(p) for p in encode_body(msg, [b"\x01" * 40])))
    for pos, val in flips:
        if pos < len(body):
            body[pos] = val
    _decode(bytes(body[: max(0, len(body) - cut)]))


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.binary(max_size=64))
def test_huge_declared_lengths_and_buffer_counts_are_rejected(header_len, n_buffers, rest):
    assert _decode(BODY_PREFIX.pack(header_len, n_buffers) + rest) is None or n_buffers == 0


@given(st.integers(2**62 + 1, 2**64 - 1))
def test_absurd_ids_are_rejected_at_decode_naming_the_field(big):
    raw = msgspec.msgpack.encode({"type": "QuorumAssigned", "step": 1, "quorum_id": big, "members": [], "rank": 0})
    body = BODY_PREFIX.pack(len(raw), 0) + raw
    try:
        decode_body(memoryview(body))
    except FrameRejected as e:
        assert "quorum_id" in str(e)
    else:
        raise AssertionError("an id past 2**62 was accepted")


def test_the_frame_prefix_is_what_the_codec_reads():
    assert BODY_PREFIX.size == struct.calcsize(">II")
