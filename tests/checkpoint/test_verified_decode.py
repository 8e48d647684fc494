"""A heal hashes the state once on each side: the source serves the checksum its encoder computed,
and the joiner, having checked the digest of what it received, does not hash it again in decode.
Any other checksum still means a full check."""

from __future__ import annotations

import hashlib

import pytest
import torch

from phalanx.checkpoint import state_codec
from phalanx.checkpoint.state_codec import (
    capture_training_state, decode_training_state, encode_training_state, header_checksum,
)
from phalanx.core.errors import StateCorrupt


def _encoded() -> tuple[bytes, list[memoryview]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return encode_training_state(capture_training_state(model, torch.optim.SGD(model.parameters(), lr=0.1), {}))


def _digest(buffers: list[memoryview]) -> str:
    h = hashlib.sha256()
    for b in buffers:
        h.update(b)
    return h.hexdigest()


def test_the_header_declares_the_digest_of_the_buffers() -> None:
    header, buffers = _encoded()
    assert header_checksum(header) == _digest(buffers)
    assert header_checksum(b"{not json") == "" and header_checksum(b'{"tensors": 3}') == ""


def test_a_decode_of_buffers_already_verified_does_not_hash_them_again(monkeypatch: pytest.MonkeyPatch) -> None:
    header, buffers = _encoded()
    calls = []
    real = state_codec.state_checksum
    monkeypatch.setattr(state_codec, "state_checksum", lambda bufs: calls.append(1) or real(bufs))
    a = decode_training_state(header, buffers, verified_sha256=_digest(buffers))
    assert calls == []
    b = decode_training_state(header, buffers)
    assert calls == [1]
    assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors))


def test_any_other_verified_value_still_checks_and_refuses_a_corrupt_state() -> None:
    header, buffers = _encoded()
    corrupt = [memoryview(bytearray(b)) for b in buffers]
    corrupt[0][0] ^= 0xFF
    with pytest.raises(StateCorrupt, match="checksum"):
        decode_training_state(header, corrupt, verified_sha256=_digest(corrupt))  # not what the header says
    with pytest.raises(StateCorrupt, match="checksum"):
        decode_training_state(header, corrupt)
