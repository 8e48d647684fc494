import json

import pytest
import torch

from phalanx.checkpoint import durable
from phalanx.checkpoint.state_codec import (
    capture_training_state, chunk_buffers, decode_training_state, encode_training_state, join_chunks,
    restore_training_state,
)
from phalanx.core.errors import CheckpointError, StateCorrupt


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _fresh():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_state_round_trips_through_the_wire_encoding_and_chunks():
    model, opt = _trained()
    header, buffers = encode_training_state(capture_training_state(model, opt, {"step": 7}))
    chunks = chunk_buffers(buffers, 100)
    assert all(c.nbytes <= 100 for c in chunks)
    state = decode_training_state(header, join_chunks(chunks, [b.nbytes for b in buffers]))
    m2, o2 = _fresh()
    extra = restore_training_state(m2, o2, state)
    assert extra == {"step": 7} and _same(model, m2)
    assert o2.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    # both continue identically
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (m2, o2)):
        m(x).sum().backward()
        o.step()
    assert _same(model, m2)


def test_a_flipped_bit_in_transferred_state_is_refused():
    model, opt = _trained()
    header, buffers = encode_training_state(capture_training_state(model, opt, {}))
    raw = bytearray(b"".join(bytes(b) for b in buffers))
    raw[10] ^= 0x01
    with pytest.raises(StateCorrupt):
        decode_training_state(header, join_chunks([memoryview(bytes(raw))], [b.nbytes for b in buffers]))
    with pytest.raises(StateCorrupt):
        decode_training_state(b"{not json", buffers)
    with pytest.raises(StateCorrupt):
        join_chunks([memoryview(bytes(raw[:-1]))], [b.nbytes for b in buffers])


def test_checkpoints_are_atomic_checksummed_and_pickle_free(tmp_path):
    model, opt = _trained()
    for step in (9, 19, 29, 39):
        durable.write_checkpoint(tmp_path, step, capture_training_state(model, opt, {"step": step}), {"q": 1})
    cks = durable.list_checkpoints(tmp_path)
    assert [p.name for p in cks] == ["step_00000019", "step_00000029", "step_00000039"]  # keep_last=3
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "checkpoints").iterdir())
    path, step = durable.latest_checkpoint(tmp_path)
    assert step == 39
    st, state, meta = durable.read_checkpoint(path)
    m2, o2 = _fresh()
    restore_training_state(m2, o2, state)
    assert _same(model, m2) and meta == {"q": 1}
    # the format is safetensors: an 8-byte little-endian header length then a JSON header
    data = (path / "state.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    assert json.loads(data[8 : 8 + n])["__metadata__"]["format"] == "phalanx-checkpoint"
    assert b"\x80\x04" not in data[:2]


def test_a_corrupt_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path):
    model, opt = _trained()
    for step in (9, 19):
        durable.write_checkpoint(tmp_path, step, capture_training_state(model, opt, {}), {})
    newest = durable.list_checkpoints(tmp_path)[-1] / "state.safetensors"
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF
    newest.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its manifest"):
        durable.read_checkpoint(newest.parent)
    assert durable.latest_checkpoint(tmp_path)[1] == 9


def test_tensor_files_round_trip(tmp_path):
    t = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([1, 2], dtype=torch.int64),
         "c": torch.ones(3, dtype=torch.bfloat16)}
    durable.write_tensors_file(tmp_path / "x.safetensors", t)
    back = durable.read_tensors_file(tmp_path / "x.safetensors")
    assert all(torch.equal(t[k], back[k]) and t[k].dtype == back[k].dtype for k in t)
