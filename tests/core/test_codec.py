import msgspec
import pytest

from phalanx.core import auth
from phalanx.core.codec import check_version, decode_body, encode_body, encoded_size
from phalanx.core.errors import FrameRejected, ProtocolVersionError
from phalanx.core.messages import AllreduceDone, HealChunk, Heartbeat, QuorumAssigned


def _join(parts):
    return memoryview(b"".join(bytes(p) for p in parts))


@pytest.mark.parametrize("message", [
    Heartbeat(seq=1, step=7),
    AllreduceDone(step=3, quorum_id=9, ok=False, error="peer gone", loss=1.5),
    QuorumAssigned(step=1, quorum_id=2, members=["w0", "w1"], rank=1, heal_targets=["w1"]),
])
def test_message_round_trips_through_frame_body(message):
    decoded, buffers = decode_body(_join(encode_body(message)))
    assert decoded == message and buffers == []


def test_raw_buffers_travel_beside_the_header_unchanged():
    blobs = [b"abc", bytes(range(256)) * 10, b""]
    decoded, buffers = decode_body(_join(encode_body(HealChunk(index=4), blobs)))
    assert decoded == HealChunk(index=4)
    assert [bytes(b) for b in buffers] == blobs


def test_encoded_size_counts_header_buffers_length_and_mac():
    size = encoded_size(HealChunk(index=0), [b"x" * 1000])
    assert size > 1000 + 32 + 4


@pytest.mark.parametrize("body, problem", [
    (b"\x00\x00", "shorter than its prefix"),
    (b"\x00\x00\x00\x10\x00\x00\x00\x00" + b"\x01", "runs past the end"),
    (b"\x00\x00\x00\x01\x00\x00\x00\x00" + b"\xc1", "undecodable"),
    (b"\x00\x00\x00\x00\x00\x01\x00\x00", "at most"),
])
def test_garbled_bodies_are_rejected_with_a_reason(body, problem):
    with pytest.raises(FrameRejected, match=problem):
        decode_body(memoryview(body))


def test_header_of_an_unknown_message_type_is_rejected():
    header = msgspec.msgpack.encode({"type": "Exploit", "x": 1})
    body = len(header).to_bytes(4, "big") + b"\x00\x00\x00\x00" + header
    with pytest.raises(FrameRejected, match="undecodable"):
        decode_body(memoryview(body))


def test_version_mismatch_names_both_versions():
    with pytest.raises(ProtocolVersionError, match="peer speaks 2, this build speaks 1"):
        check_version(2, 1)


def test_frame_mac_depends_on_key_direction_sequence_and_body():
    key = auth.session_key(b"t" * 32, b"a" * 16, b"b" * 16)
    base = auth.frame_mac(key, b"C", 0, [b"body"])
    assert base != auth.frame_mac(key, b"S", 0, [b"body"])
    assert base != auth.frame_mac(key, b"C", 1, [b"body"])
    assert base != auth.frame_mac(key, b"C", 0, [b"bodx"])
    other = auth.session_key(b"u" * 32, b"a" * 16, b"b" * 16)
    assert base != auth.frame_mac(other, b"C", 0, [b"body"])
    assert auth.macs_equal(base, auth.frame_mac(key, b"C", 0, [b"bo", b"dy"]))


def test_short_token_file_is_refused(tmp_path):
    p = tmp_path / "tok"
    p.write_text("short")
    with pytest.raises(Exception, match="at least 16"):
        auth.read_token_file(p)


def test_token_file_is_private(tmp_path):
    p = tmp_path / "tok"
    auth.write_token_file(p, auth.generate_token())
    assert p.stat().st_mode & 0o077 == 0
    assert len(auth.read_token_file(p)) == 64


def test_a_keyed_mac_copied_per_frame_gives_the_same_bytes_as_frame_mac():
    key = auth.session_key(b"t" * 32, b"n" * 16, b"m" * 16)
    keyed = auth.frame_mac_key(key)
    for direction, seq, parts in ((b"C", 0, [b"body"]), (b"S", 7, [b"bo", memoryview(b"dy")]), (b"C", 2**40, [])):
        assert auth.frame_mac_with(keyed, direction, seq, parts) == auth.frame_mac(key, direction, seq, parts)
