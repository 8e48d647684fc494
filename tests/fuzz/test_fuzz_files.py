"""Files are input too: fault plans and checkpoints, random or mutated, parse or raise the typed
error with a location; nothing else escapes, nothing runs."""

import json
import struct

from hypothesis import given
from hypothesis import strategies as st

from phalanx.checkpoint.durable import decode_safetensors, encode_safetensors
from phalanx.core.errors import CheckpointError, FaultPlanError
from phalanx.faults.plan import parse_fault_plan

KEYS = ["kind", "worker", "at_step", "at_s", "for_s", "factor", "restart", "phase", "groups", "isolate", "workers",
        "pair", "one_way", "mean_ms", "jitter_ms", "distribution", "probability", "bytes_per_s", "delay_ms",
        "restart_after_s", "colour"]
KINDS = ["kill", "freeze", "gil_hang", "hang", "straggler", "partition", "latency", "loss", "bandwidth", "duplicate",
         "reorder", "coordinator_kill", "join", "explode"]
TOML_VALUES = st.sampled_from(["1", "0", "-1", "2.5", "nan", "inf", "-inf", "1e308", "true", '"x"', "[0, 1]", "[[0], [1]]",
                               "[[0, 1], [1]]", "[]", "[1, 1]", '"normal"', '"pareto"', "99999999999", "[0, 1, 2]",
                               '"allreduce"', "{a = 1}"])


@st.composite
def plans(draw):
    lines = []
    for _ in range(draw(st.integers(0, 4))):
        lines.append("[[fault]]")
        lines.append(f'kind = "{draw(st.sampled_from(KINDS))}"')
        for key in draw(st.lists(st.sampled_from(KEYS), max_size=6, unique=True)):
            lines.append(f"{key} = {draw(TOML_VALUES)}")
    return "\n".join(lines) + "\n"


@given(plans())
def test_any_plan_parses_or_names_its_line(text):
    try:
        plan = parse_fault_plan(text, "p.toml")
    except FaultPlanError as e:
        assert e.path == "p.toml" and "fault" in str(e) or "TOML" in str(e) or e.line is None
        return
    plan.validate_workers(4) if all((f.worker or 0) < 4 for f in plan.faults) else None
    for f in plan.faults:
        for v in (f.at_s, f.for_s, f.factor):
            assert v is None or v == v and abs(v) != float("inf")  # finite, never NaN


@given(st.text(max_size=300))
def test_random_text_as_a_plan_is_refused_cleanly(text):
    try:
        parse_fault_plan(text, "p.toml")
    except FaultPlanError:
        pass


def _valid_file():
    import torch

    parts = encode_safetensors({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                                "b": torch.ones(4, dtype=torch.int64)}, {"tree": "{}"})
    return b"".join(bytes(p) for p in parts)


VALID = _valid_file()


@given(st.binary(max_size=512))
def test_random_bytes_as_a_checkpoint_are_refused(data):
    try:
        decode_safetensors(data, "x.safetensors")
    except CheckpointError:
        pass


@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), max_size=6), st.integers(0, 64))
def test_mutated_checkpoints_load_or_are_refused(flips, cut):
    data = bytearray(VALID)
    for pos, val in flips:
        data[pos] = val
    try:
        decode_safetensors(bytes(data[: len(data) - cut]), "x.safetensors")
    except CheckpointError:
        pass


JSON_ANY = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                        lambda i: st.lists(i, max_size=3) | st.dictionaries(st.text(max_size=5), i, max_size=3),
                        max_leaves=10)


@given(JSON_ANY)
def test_any_json_header_is_checked_before_it_is_used(header):
    h = json.dumps(header).encode()
    try:
        decode_safetensors(struct.pack("<Q", len(h)) + h + b"\x00" * 16, "x.safetensors")
    except CheckpointError:
        pass
