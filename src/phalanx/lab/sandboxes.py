"""Sandboxes for the mechanisms that are not a training-job setting: frame authentication and
run-folder ownership. Each builds its own victim from phalanx's real functions, attacks it, and
counts what got through. Nothing outside the sandbox is touched."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from phalanx.core.auth import generate_token
from phalanx.core.errors import ConfigError, TransportError
from phalanx.core.messages import Heartbeat, StepDecision
from phalanx.lab.switches import LabSwitches
from phalanx.runtime.run_dir import MARKER, claim_run_dir, clear_run_outputs
from phalanx.transport.tcp import TcpConnection, TcpTransport

PUBLIC_KEY = b""  # authentication off: a key everyone knows, so anyone can compute valid MACs


def forged_frame_trial(sw: LabSwitches) -> dict[str, Any]:
    """A real TcpTransport listener on loopback; an attacker without the cluster token sends a
    forged ``StepDecision(commit=True)``; a genuine peer sends a heartbeat. What was delivered?"""
    return asyncio.run(asyncio.wait_for(_forged_frame(sw), 20.0))


async def _forged_frame(sw: LabSwitches) -> dict[str, Any]:
    token = generate_token() if sw.authentication else PUBLIC_KEY
    attacker_token = generate_token() if sw.authentication else PUBLIC_KEY  # it can only guess the secret
    victim = TcpTransport(token, "lab-victim", handshake_timeout_s=2.0)
    received: list[Any] = []

    async def serve(conn: TcpConnection) -> None:
        try:
            for _ in range(16):  # bounded: the sandbox expects one frame per peer
                msg, _ = await conn.recv()
                received.append(msg)
        except TransportError:
            pass

    listener = await victim.listen("127.0.0.1:0", serve)
    try:
        handshake = await _send(TcpTransport(attacker_token, "w0", handshake_timeout_s=2.0), listener.address,
                                StepDecision(step=7, quorum_id=3, commit=True, reason="forged by the lab"))
        await _send(TcpTransport(token, "w1", handshake_timeout_s=2.0), listener.address, Heartbeat(seq=1, step=0))
        for _ in range(50):  # wait (bounded) for the frames to arrive
            if sum(isinstance(m, Heartbeat) for m in received) and (handshake != "accepted" or any(
                    isinstance(m, StepDecision) for m in received)):
                break
            await asyncio.sleep(0.02)
    finally:
        listener.close()
    forged = [m for m in received if isinstance(m, StepDecision)]
    return {"handshake": handshake, "forged_accepted": len(forged),
            "genuine_accepted": sum(isinstance(m, Heartbeat) for m in received),
            "rejections": sum(victim.stats.rejected.values()), "rejected_by_kind": dict(victim.stats.rejected),
            "delivered": (f"the victim decoded StepDecision(step={forged[0].step}, quorum_id={forged[0].quorum_id}, "
                          f"commit={forged[0].commit}) as if its coordinator had sent it") if forged else ""}


async def _send(transport: TcpTransport, address: str, message: Any) -> str:
    try:
        conn = await transport.connect(address, 2.0)
    except TransportError as e:
        return f"refused: {e}"
    try:
        await conn.send(message)
        await asyncio.sleep(0.05)
    finally:
        conn.close()
    return "accepted"


THEIR_FILES = ("report.html", "summary.json", "notes.txt", "checkpoints/model-final.pt", "checkpoints/optimizer.pt",
               "data/train.csv")


def foreign_folder_trial(sandbox: Path, sw: LabSwitches) -> dict[str, Any]:
    """Another person's folder given as a run folder: the real claim / clear functions, with the
    ownership check (the .phalanx-run marker) or without it (the folder simply adopted)."""
    sandbox.mkdir(parents=True, exist_ok=False)  # a fresh sandbox inside this experiment's own folder
    for rel in THEIR_FILES:
        p = sandbox / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"someone else's {rel}\n")
    before = _files(sandbox)
    refused = ""
    try:
        if not sw.run_dir_ownership:
            (sandbox / MARKER).write_text('{"phalanx_run": true}')  # adopted without looking
        claim_run_dir(sandbox)
        clear_run_outputs(sandbox)
    except ConfigError as e:
        refused = str(e)
    after = _files(sandbox)
    return {"files_before": len(before), "files_deleted": len(before - after), "refused": refused,
            "deleted": sorted(before - after)}


def _files(root: Path) -> set[str]:
    out = set()
    for dirpath, _, names in os.walk(root):
        for n in names:
            if n != MARKER:
                out.add(str(Path(dirpath, n).relative_to(root)))
    return out
