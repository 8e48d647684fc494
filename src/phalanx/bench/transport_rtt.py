"""`python -m phalanx.bench transport`: a step's report and its decision over phalanx's control-plane
transport (TcpTransport on the real event loop: framing, HMAC both ways, msgspec) against the same
number of bytes over a plain blocking socket, between two processes, alternating run by run.

    python -m phalanx.bench transport [--round-trips 2000] [--gap-ms 5] [--repeats 3]

The client waits ``--gap-ms`` between round trips, as a worker's connection idles through a step's
compute (back to back, caches and cores stay warm and the figure is the best case). Per run: the
median round trip and the CPU each side spends a round trip (``time.thread_time``); per pair, the
ratio phalanx / raw. The raw socket is the floor any transport on this box pays; the difference is
phalanx's event loop, framing and authentication.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from phalanx.core import auth, event_loop
from phalanx.core.codec import LEN, body_length, encode_body
from phalanx.core.messages import AllreduceDone, StepDecision
from phalanx.transport.tcp import TcpTransport

TOKEN = b"bench-transport-token-0123456789"
REPORT = AllreduceDone(step=7, quorum_id=1, ok=True, error="", loss=1.5, samples_covered_once=True, compute_s=0.04,
                       allreduce_s=0.001, next_step=8)
DECISION = StepDecision(step=7, quorum_id=1, commit=True, reason="", loss=1.25)


def _frame_bytes(message: Any) -> int:
    return body_length(encode_body(message)) + LEN.size + auth.MAC_BYTES


def _recv_exactly(conn: socket.socket, n: int) -> None:
    got = 0
    while got < n:
        got += len(conn.recv(n - got))


def _serve(kind: str, n: int) -> None:
    """The server process: answer ``n`` round trips, then print its CPU a round trip."""
    if kind == "raw":
        srv = socket.create_server(("127.0.0.1", 0))
        print(srv.getsockname()[1], flush=True)
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        want, reply = _frame_bytes(REPORT), b"d" * _frame_bytes(DECISION)
        c0 = time.thread_time()
        for _ in range(n):
            _recv_exactly(conn, want)
            conn.sendall(reply)
        print((time.thread_time() - c0) / n, flush=True)
        return

    async def main() -> None:
        done = asyncio.Event()

        async def on(conn: Any) -> None:
            c0 = time.thread_time()
            for _ in range(n):
                await conn.recv()
                await conn.send(DECISION)
            print((time.thread_time() - c0) / n, flush=True)
            done.set()

        listener = await TcpTransport(TOKEN, "bench-server").listen("127.0.0.1:0", on)
        print(listener.address.rpartition(":")[2], flush=True)
        await done.wait()
    event_loop.run(main())


def _client(kind: str, port: int, n: int, gap_s: float) -> tuple[list[float], float]:
    lat: list[float] = []
    if kind == "raw":
        conn = socket.create_connection(("127.0.0.1", port))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg, want = b"r" * _frame_bytes(REPORT), _frame_bytes(DECISION)
        c0 = time.thread_time()
        for _ in range(n):
            t0 = time.monotonic()
            conn.sendall(msg)
            _recv_exactly(conn, want)
            lat.append(time.monotonic() - t0)
            time.sleep(gap_s)
        return lat, (time.thread_time() - c0) / n

    async def main() -> float:
        conn = await TcpTransport(TOKEN, "bench-client").connect(f"127.0.0.1:{port}", 10)
        c0 = time.thread_time()
        for _ in range(n):
            t0 = time.monotonic()
            await conn.send(REPORT)
            await conn.recv()
            lat.append(time.monotonic() - t0)
            time.sleep(gap_s)  # idle, as through a step's compute (the loop has nothing else to do)
        return (time.thread_time() - c0) / n
    return lat, event_loop.run(main())


def run_one(kind: str, n: int, gap_s: float) -> dict[str, float]:
    server = subprocess.Popen([sys.executable, "-m", "phalanx.bench.transport_rtt", "--serve", kind, str(n)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        lat, client_cpu = _client(kind, port, n, gap_s)
        server_cpu = float(server.stdout.readline())
    finally:
        server.wait(30)
    return {"rtt_us": statistics.median(lat) * 1e6, "client_cpu_us": client_cpu * 1e6,
            "server_cpu_us": server_cpu * 1e6}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        _serve(sys.argv[2], int(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--round-trips", type=int, default=2000)
    ap.add_argument("--gap-ms", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="runs/bench/transport.json")
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"phalanx": [], "raw": []}
    for i in range(args.repeats):
        for kind in (("phalanx", "raw") if i % 2 == 0 else ("raw", "phalanx")):
            r = run_one(kind, args.round_trips, args.gap_ms / 1e3)
            runs[kind].append(r)
            print(f"[{i + 1}/{args.repeats}] {kind:8s} round trip {r['rtt_us']:6.0f} us, CPU a round trip: "
                  f"client {r['client_cpu_us']:5.0f} us, server {r['server_cpu_us']:5.0f} us", file=sys.stderr)
    ratios = {k: [p[k] / r[k] for p, r in zip(runs["phalanx"], runs["raw"])]
              for k in ("rtt_us", "client_cpu_us", "server_cpu_us")}
    for k, v in ratios.items():
        print(f"phalanx / raw, {k}: median {statistics.median(v):.2f} (pairs: {', '.join(f'{x:.2f}' for x in v)})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python -m phalanx.bench transport " + " ".join(sys.argv[1:]),
                               "round_trips": args.round_trips, "gap_ms": args.gap_ms, "runs": runs,
                               "ratios": ratios, "unix_s": time.time()}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
