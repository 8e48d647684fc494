"""Durable checkpoints: atomic (temp dir, fsync, rename), checksummed, safetensors format + JSON
manifest. Loading runs no code: it parses a length-prefixed JSON header and raw bytes."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint.state_codec import DTYPES, TrainingState, _raw
from phalanx.core.errors import CheckpointError

log = logging.getLogger("phalanx.checkpoint")
ST_DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
             "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
FROM_ST = {v: k for k, v in ST_DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024


def _dtype_name(t: torch.Tensor) -> str:
    return next(k for k, v in DTYPES.items() if v == t.dtype)


def encode_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> list[bytes | memoryview]:
    header: dict[str, Any] = {"__metadata__": metadata}
    buffers, pos = [], 0
    for name, t in tensors.items():
        b = _raw(t)
        header[name] = {"dtype": ST_DTYPES[_dtype_name(t)], "shape": list(t.shape), "data_offsets": [pos, pos + b.nbytes]}
        buffers.append(b)
        pos += b.nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return [struct.pack("<Q", len(h)), h, *buffers]


def decode_safetensors(data: bytes, where: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if len(data) < 8:
        raise CheckpointError(f"{where}: file of {len(data)} bytes is too short")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > min(MAX_HEADER_BYTES, len(data) - 8):
        raise CheckpointError(f"{where}: header length {n} is impossible for a {len(data)}-byte file")
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as e:
        raise CheckpointError(f"{where}: header is not JSON ({e})") from e
    meta = _checked_header(header, where)
    body = memoryview(data)[8 + n :]
    out, expect = {}, 0
    for name, m in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = m["data_offsets"]
        dtype = FROM_ST.get(m["dtype"])
        if dtype is None or begin != expect or end > body.nbytes:
            raise CheckpointError(f"{where}: tensor {name!r} has a bad dtype or offsets")
        size = math.prod(m["shape"]) * torch.empty(0, dtype=DTYPES[dtype]).element_size()
        if size != end - begin:
            raise CheckpointError(f"{where}: tensor {name!r} has {end - begin} bytes for shape {m['shape']}")
        raw = torch.frombuffer(bytearray(body[begin:end]), dtype=DTYPES[dtype]) if size else torch.empty(0, dtype=DTYPES[dtype])
        out[name] = raw.reshape(m["shape"])
        expect = end
    if expect != body.nbytes:
        raise CheckpointError(f"{where}: {body.nbytes - expect} trailing bytes after the last tensor")
    return out, meta


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 2**62


def _checked_header(header: Any, where: str) -> dict[str, str]:
    """The header's shape, checked before anything is read from it (a local file is input too):
    {"__metadata__": {str: str}, name: {"dtype": str, "shape": [int...], "data_offsets": [int, int]}}.
    Pops and returns the metadata."""
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: header is a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CheckpointError(f"{where}: __metadata__ must map strings to strings")
    for name, m in header.items():
        ok = (isinstance(m, dict) and isinstance(m.get("dtype"), str) and isinstance(m.get("shape"), list)
              and all(_is_count(d) for d in m["shape"]) and len(m["shape"]) <= 64
              and isinstance(m.get("data_offsets"), list) and len(m["data_offsets"]) == 2
              and all(_is_count(o) for o in m["data_offsets"]) and m["data_offsets"][0] <= m["data_offsets"][1])
        if not ok:
            raise CheckpointError(f"{where}: tensor {name!r} needs a dtype string, a shape of non-negative integers "
                                  f"and data_offsets [begin, end]; got {str(m)[:200]}")
    return meta


def _fsync_write(path: Path, parts: list[bytes | memoryview]) -> str:
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for p in parts:
            f.write(p)
            h.update(p)
        f.flush()
        os.fsync(f.fileno())
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tensors_file(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A plain safetensors file, written atomically (used for final parameters)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    _fsync_write(tmp, encode_safetensors(tensors, {"format": "phalanx-tensors"}))
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def read_tensors_file(path: Path) -> dict[str, torch.Tensor]:
    return decode_safetensors(Path(path).read_bytes(), str(path))[0]


def write_checkpoint(run_dir: Path, step: int, state: TrainingState, meta: dict[str, Any], keep_last: int = 3) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tensors = {f"t{i}": t for i, t in enumerate(state.tensors)}
    parts = encode_safetensors(tensors, {"format": "phalanx-checkpoint", "tree": json.dumps(state.tree)})
    digest = _fsync_write(tmp / "state.safetensors", parts)
    manifest = {"format": "phalanx-checkpoint", "format_version": 1, "step": step, "file": "state.safetensors",
                "bytes": (tmp / "state.safetensors").stat().st_size, "sha256": digest,
                "created_unix_s": time.time(), "meta": meta}
    _fsync_write(tmp / "manifest.json", [json.dumps(manifest, indent=2).encode()])
    if final.exists():
        shutil.rmtree(tmp)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_checkpoint(path: str | Path) -> tuple[int, TrainingState, dict[str, Any]]:
    """Load a checkpoint folder; every field is checked (a CheckpointError names the problem)."""
    p = Path(path)
    try:
        manifest = json.loads((p / "manifest.json").read_text())
        if not isinstance(manifest, dict):
            raise ValueError("manifest.json is not a JSON object")
        name = manifest["file"]
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"'file' must be a plain file name inside the checkpoint, got {name!r}")
        data = (p / name).read_bytes()
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{p}: unreadable checkpoint ({e})") from e
    if len(data) != manifest.get("bytes") or hashlib.sha256(data).hexdigest() != manifest.get("sha256"):
        raise CheckpointError(f"{p}: state file does not match its manifest (size or SHA-256): corrupt or truncated")
    tensors, meta = decode_safetensors(data, str(p / name))
    try:
        tree = json.loads(meta["tree"])
        state = TrainingState(tree, [tensors[f"t{i}"] for i in range(len(tensors))])
        step = manifest["step"]
        if not _is_count(step) or not isinstance(manifest.get("meta", {}), dict):
            raise ValueError(f"step {step!r} / meta are malformed")
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{p}: checkpoint contents are malformed ({e})") from e
    return int(step), state, manifest.get("meta", {})


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))


def latest_checkpoint(run_dir: Path) -> tuple[Path, int] | None:
    for p in reversed(list_checkpoints(run_dir)):
        try:
            step, _, _ = read_checkpoint(p)
            return p, step
        except CheckpointError as e:
            log.warning("skipping checkpoint %s: %s", p, e)
    return None
