"""Bad input against a live job: garbage, a wrong token, an oversized frame and a wrong protocol
version aimed at the running coordinator each close that one connection with a logged reason, and
the job finishes with the strict guarantees. A broken fault plan is refused before anything starts."""

import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from phalanx.core import auth
from phalanx.core.codec import encode_body
from phalanx.core.messages import PROTOCOL_VERSION, ClientHello


def _phalanx(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "phalanx.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _coordinator_address(run_dir: Path, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        ev = run_dir / "events.jsonl"
        if ev.exists():
            for line in ev.read_text().splitlines():
                e = json.loads(line)
                if e["event"] == "coordinator_started":
                    return e["address"]
        time.sleep(0.05)
    raise AssertionError("the coordinator never started")


def _send(address: str, data: bytes) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(data)
        s.settimeout(5)
        try:
            return s.recv(4096)  # the server closes the connection (b"") or answers with a Refused
        except (ConnectionResetError, socket.timeout):
            return b""


def _handshake_frame(token: bytes, version: int) -> bytes:
    body = b"".join(bytes(p) for p in encode_body(ClientHello(protocol_version=version, nonce=auth.new_nonce(),
                                                              client="intruder")))
    return struct.pack(">I", len(body)) + auth.handshake_mac(token, body) + body


def _wait_committed(run_dir: Path, n: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = (run_dir / "events.jsonl").read_text()
        if text.count('"step_committed"') >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} steps committed")


def test_garbage_wrong_token_oversized_and_wrong_version_frames_leave_the_job_unharmed(tmp_path):
    run_dir = tmp_path / "run"
    proc = _phalanx("train", "--workers", "2", "--steps", "60", "--no-faults", "--quiet", "--checkpoint-every", "0",
                    "--min-step-s", "0.05", "--out", str(run_dir))
    try:
        address = _coordinator_address(run_dir, proc)
        _wait_committed(run_dir, 5)
        token = auth.read_token_file(run_dir / "token")
        assert _send(address, os.urandom(64)) == b""                      # garbage
        assert _send(address, _handshake_frame(b"x" * 32, PROTOCOL_VERSION)) == b""  # wrong token
        assert _send(address, struct.pack(">I", 1 << 30) + b"\0" * 32) == b""        # 1 GiB frame header
        reply = _send(address, _handshake_frame(token, PROTOCOL_VERSION + 7))       # wrong version
        assert b"protocol" in reply.lower() or reply == b""
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"] and summary["steps_committed"] == 60 and summary["false_suspicions"] == 0
    assert summary["samples_exactly_once"] and summary["reference_max_abs_diff"] <= 1e-5
    refused = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if '"connection_refused"' in x]
    reasons = " | ".join(e["reason"] for e in refused)
    assert len(refused) >= 4, reasons
    assert "HMAC" in reasons and "exceeds the limit" in reasons and "version" in reasons, reasons


def test_a_broken_fault_plan_is_refused_with_file_and_line_before_anything_starts(tmp_path):
    plan = tmp_path / "bad.toml"
    plan.write_text('[[fault]]\nkind = "kill"\nworker = 1\nat_step = "soon"\n')
    proc = _phalanx("train", "--fault-plan", str(plan), "--out", str(tmp_path / "run"), "--quiet")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert f"{plan}:4: fault #1 (kill): 'at_step' must be an integer" in err
    assert not (tmp_path / "run" / "events.jsonl").exists()
