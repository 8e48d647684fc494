"""``phalanx soak``: a long 4-worker job through random faults and hostile connections, then checks.

Faults (kill with restart, freeze, gil_hang, hang, partition, loss, latency, coordinator_kill)
fire one at a time every few seconds from a seeded schedule, while a prober opens hostile
connections at every listening port it learns of (the coordinator's, each worker's heal port):
garbage, a handshake under the wrong token, a huge announced length, a silent connection. At the
end it checks what a long-running cluster must keep true: every sample exactly once per epoch,
strict equality with the single-process reference, no leaked worker process, file descriptor or
temp file, and launcher (coordinator) and worker memory flat after warm-up. Results go to
``soak.json`` and ``soak.md`` in the run folder.
"""

from __future__ import annotations

import json
import os
import random
import socket
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx.faults.plan import parse_fault_plan
from phalanx.runtime.train_job import TrainOptions, run_train

KINDS = ("kill", "freeze", "gil_hang", "hang", "partition", "loss", "latency", "coordinator_kill")
FAULT_GAP_S = 6.0  # one fault at a time: each has ended and been recovered from before the next
STEP_S = 0.06  # paced compute per step
RSS_GROWTH_MAX = 1.10
# Strict runs equal the reference up to summation-order rounding, which a quorum that changes size
# (every fault here) perturbs; over thousands of AdamW steps it accumulates past the 1e-5 of a
# 200-step run (measured: 2.0e-5 after 666 steps and 9 faults). A double-applied or lost step is
# orders of magnitude larger (0.1 in the end-of-job bug this soak would have caught).
REFERENCE_TOL = 1e-4


def soak_plan(duration_s: float, workers: int, seed: int) -> str:
    """A seeded schedule of faults, one every FAULT_GAP_S, cycling through every kind."""
    rng = random.Random(seed)
    kinds = list(KINDS)
    rng.shuffle(kinds)
    lines, t, i = [], 2.0, 0
    while t < duration_s - FAULT_GAP_S:
        kind, w = kinds[i % len(kinds)], rng.randrange(1, workers)  # w0 stays: a holder of the state
        spec = {"kill": f'worker = {w}\nrestart = true', "freeze": f"worker = {w}\nfor_s = 1.5",
                "gil_hang": f"worker = {w}\nfor_s = 1.5", "hang": f"worker = {w}\nfor_s = 1.5",
                "partition": f"isolate = {w}\nfor_s = 1.5", "loss": "probability = 0.05\nfor_s = 2.0",
                "latency": "mean_ms = 5\njitter_ms = 2\nfor_s = 2.0",
                "coordinator_kill": "restart_after_s = 0.5"}[kind]
        lines.append(f'[[fault]]\nkind = "{kind}"\nat_s = {t:.1f}\n{spec}\n')
        t, i = t + FAULT_GAP_S, i + 1
    return "\n".join(lines)


@dataclass
class Prober:
    """Hostile connections at every port the run listens on, until stopped (bounded: one every
    ``interval_s``)."""

    run_dir: Path
    interval_s: float = 0.25
    attempts: int = 0
    refused: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _seen: set[str] = field(default_factory=set)
    _offset: int = 0  # events.jsonl is read on from here: each probe reads only the new lines
    _inode: int = -1

    def targets(self) -> list[str]:
        try:
            with open(self.run_dir / "events.jsonl", "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self._inode or st.st_size < self._offset:  # a fresh run replaced the file
                    self._inode, self._offset = st.st_ino, 0
                    self._seen.clear()
                f.seek(self._offset)
                new = f.read()
        except OSError:
            return sorted(self._seen)
        complete = new[: new.rfind(b"\n") + 1]  # a line still being written is read next time
        self._offset += len(complete)
        for line in complete.splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") == "coordinator_started" and e.get("address"):
                self._seen.add(e["address"])
            elif e.get("event") == "worker_joined" and e.get("heal_address"):
                self._seen.add(e["heal_address"])
        return sorted(self._seen)

    def run(self) -> None:
        rng = random.Random(7)
        while not self._stop.wait(self.interval_s):
            targets = self.targets()
            if targets:
                self._probe(rng.choice(targets), rng.choice(("garbage", "wrong_token", "huge_length", "silent")), rng)

    def _probe(self, address: str, kind: str, rng: random.Random) -> None:
        from phalanx.core import auth
        from phalanx.core.codec import LEN, encode_body
        from phalanx.core.messages import PROTOCOL_VERSION, ClientHello

        host, port = address.rsplit(":", 1)
        self.attempts += 1
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        try:
            with socket.create_connection((host, int(port)), timeout=2.0) as s:
                if kind == "garbage":
                    s.sendall(rng.randbytes(rng.randrange(1, 200)))
                elif kind == "wrong_token":
                    body = b"".join(bytes(p) for p in encode_body(ClientHello(
                        protocol_version=PROTOCOL_VERSION, nonce=os.urandom(16), client="intruder")))
                    s.sendall(LEN.pack(len(body)) + auth.handshake_mac(b"x" * 32, body) + body)
                elif kind == "huge_length":
                    s.sendall(LEN.pack(2**31) + b"\0" * 32)
                s.settimeout(7.0)  # silent: the server's handshake deadline closes it
                if s.recv(1 << 16) == b"":
                    self.refused += 1
        except OSError:
            self.refused += 1  # reset or closed: refused either way

    def stop(self) -> None:
        self._stop.set()


def _rss_kib(pid: int | str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _run_processes(run_dir: Path) -> list[int]:
    """Pids whose environment names this run folder (its workers, if any are left)."""
    needle = f"PHALANX_RUN_DIR={run_dir}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


def _sockets_and_pipes() -> dict[str, str]:
    """This process's open sockets and pipes, fd -> what it is: what a leaked connection or
    process would hold (a font a report's plot loaded once is not a leak)."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith(("socket:", "pipe:")):
            out[fd] = link + _socket_detail(link)
    return out


def _socket_detail(link: str) -> str:
    """' tcp 127.0.0.1:PORT->...' for a socket inode, so a leak report says what it is."""
    if not link.startswith("socket:"):
        return ""
    inode = link[8:-1]
    for name in ("tcp", "tcp6", "unix", "udp"):
        try:
            for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
                cols = line.split()
                if name == "unix" and len(cols) > 6 and cols[6] == inode:
                    return f" unix {cols[-1] if len(cols) > 7 else ''}"
                if name != "unix" and len(cols) > 9 and cols[9] == inode:
                    lport, rport = int(cols[1].split(":")[1], 16), int(cols[2].split(":")[1], 16)
                    return f" {name} :{lport}->:{rport} state {cols[3]}"
        except OSError:
            continue
    return ""


def _open_sockets_and_pipes() -> int:
    return len(_sockets_and_pipes())


def _flat(series: list[int]) -> float | None:
    """Late RSS over RSS just after warm-up (the second quarter against the last quarter)."""
    if len(series) < 8:
        return None
    q = len(series) // 4
    return statistics.median(series[-q:]) / statistics.median(series[q : 2 * q])


def run_soak(duration_s: float, run_dir: Path, seed: int = 0, workers: int = 4,
             show_progress: bool = True) -> dict[str, Any]:
    plan_text = soak_plan(duration_s, workers, seed)
    steps = int(duration_s / (STEP_S + 0.03))
    from phalanx.collectives.process_group import RendezvousStore

    RendezvousStore("127.0.0.1")  # torch's one-time globals (a libuv pipe pair) before counting fds
    fds_before = _open_sockets_and_pipes()
    open_before = _sockets_and_pipes()
    tmp_before = set(os.listdir(tempfile.gettempdir()))
    prober = Prober(run_dir)
    samples: dict[str, list[int]] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(1.0):
            pids = _run_processes(run_dir)
            if not pids:
                continue  # before the workers start or after they end (the reference then runs here)
            samples.setdefault("launcher", []).append(_rss_kib("self") or 0)
            for pid in pids:
                rss = _rss_kib(pid)
                if rss:
                    samples.setdefault(str(pid), []).append(rss)

    threads = [threading.Thread(target=prober.run, daemon=True), threading.Thread(target=sample, daemon=True)]
    for t in threads:
        t.start()
    try:
        summary = run_train(TrainOptions(workers=workers, steps=steps, seed=seed, run_dir=run_dir,
                                         fault_plan=parse_fault_plan(plan_text, "<soak>"), checkpoint_every_steps=25,
                                         min_step_s=STEP_S, show_progress=show_progress))
    finally:
        prober.stop()
        stop.set()
        for t in threads:
            t.join(10)
    time.sleep(0.5)
    import gc

    gc.collect()  # a reference cycle is not a leak: count what outlives a collection
    leaked = _run_processes(run_dir)
    new_tmp = sorted(n for n in set(os.listdir(tempfile.gettempdir())) - tmp_before
                     if n.startswith(("phx", "phalanx", "tmp")))
    growth = {k: _flat(v) for k, v in samples.items()}
    measured = {k: round(g, 3) for k, g in growth.items() if g is not None}
    result = {
        "ok": False, "duration_s": duration_s, "steps": steps, "seed": seed,
        "faults_injected": len(summary.get("faults", [])),
        "faults_recovered": sum(1 for f in summary.get("faults", []) if f.get("recovered_after_s") is not None),
        "fault_kinds": sorted({f["kind"] for f in summary.get("faults", [])}),
        "hostile_connections": prober.attempts, "hostile_refused": prober.refused, "hostile_kinds": prober.by_kind,
        "train_ok": bool(summary.get("steps_committed") == steps), "train_reason": summary.get("reason", ""),
        "samples_exactly_once": summary.get("samples_exactly_once"),
        "reference_max_abs_diff": summary.get("reference_max_abs_diff"),
        "leaked_processes": leaked, "sockets_and_pipes_before": fds_before,
        "sockets_and_pipes_after": _open_sockets_and_pipes(),
        "sockets_and_pipes_new": {fd: link for fd, link in _sockets_and_pipes().items() if open_before.get(fd) != link},
        "new_temp_files": new_tmp, "rss_growth": measured,
        "rss_launcher_kib": [samples.get("launcher", [0])[0], samples.get("launcher", [0])[-1]],
    }
    result["ok"] = bool(
        result["train_ok"] and result["samples_exactly_once"]
        and (result["reference_max_abs_diff"] or 1.0) <= REFERENCE_TOL and not leaked and not new_tmp
        and result["sockets_and_pipes_after"] <= fds_before and all(g <= RSS_GROWTH_MAX for g in measured.values())
        and prober.refused == prober.attempts)
    (run_dir / "soak.json").write_text(json.dumps(result, indent=2))
    (run_dir / "soak.md").write_text("| measure | value |\n|---|---|\n" + "".join(
        f"| {k} | {v} |\n" for k, v in result.items()))
    return result
