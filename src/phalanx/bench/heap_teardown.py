"""How long a SIGKILLed worker's connections stay open, by the size of its heap: on the kernel's
4 KiB pages against transparent huge pages (what phalanx's launcher gives its workers,
train/host_memory.py), alternating, in one run.

    python -m phalanx.bench teardown [--gib 0.25,1,4] [--repeats 3] [--busy 0]
                                     [--out runs/bench/teardown.json]

The kernel frees a killed process's memory before it closes its file descriptors, so the
coordinator and the peers read the closed connection (a kill's detection) only after that. Each
measurement starts a process that imports torch and fills the given GiB with CPU tensors of
64 MiB, connects to this one, and is SIGKILLed; the time is from the kill to this side's read of
the end of the stream. ``--busy N`` keeps N processes spinning at nice +10 meanwhile, as a job's
survivors compute while the victim is torn down. The last column says how much of each variant's
heap was on huge pages: where the kernel's transparent huge pages are ``always`` rather than
``madvise``, the variant without the tunable gets some too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from phalanx.train.host_memory import HUGETLB_TUNABLE, worker_hugepage_env

_CHILD = ("import os, socket, sys, time\n"
          "import torch\n"
          "held = [torch.ones(16 * 2**20) for _ in range(round(float(sys.argv[2]) * 16))]  # 64 MiB each\n"
          "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
          "s.sendall(b'r')\n"
          "time.sleep(120)\n")
_SPIN = "import os\nos.nice(10)\nimport time\nend = time.monotonic() + 600\nwhile time.monotonic() < end: pass\n"


def _anon_huge_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("AnonHugePages:")), 0)
    except OSError:
        return 0


def measure(gib: float, env: dict[str, str]) -> tuple[float, int]:
    """Seconds from SIGKILL to EOF for one process holding ``gib`` GiB, and its KiB on huge pages."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.settimeout(120)
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(srv.getsockname()[1]), str(gib)], env=env)
        try:
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(60)
                if conn.recv(1) != b"r":
                    raise RuntimeError("the probe process closed before it was ready")
                time.sleep(0.2)
                huge = _anon_huge_kib(proc.pid)
                t0 = time.monotonic()
                os.kill(proc.pid, signal.SIGKILL)
                conn.recv(1)  # b"" at the end of the stream, or a reset
                return time.monotonic() - t0, huge
        finally:
            proc.kill()
            proc.wait()


def run(sizes: list[float], repeats: int, busy: int, console: Console) -> list[dict[str, Any]]:
    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    extra, why = worker_hugepage_env(plain)
    if not extra:
        raise SystemExit(f"nothing to compare on this machine: {why}")
    variants = {"4 KiB pages": plain, "huge pages": {**plain, **extra}}
    spinners = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(busy)]
    rows = []
    try:
        for gib in sizes:
            row: dict[str, Any] = {"gib": gib, "busy": busy, "s": {v: [] for v in variants},
                                   "huge_kib": {v: [] for v in variants}}
            for r in range(repeats):
                order = list(variants) if r % 2 == 0 else list(reversed(variants))
                for name in order:
                    console.print(f"{gib} GiB, repeat {r + 1}/{repeats}: {name}")
                    s, huge = measure(gib, variants[name])
                    row["s"][name].append(round(s, 5))
                    row["huge_kib"][name].append(huge)
            row["ratio"] = [round(h / p, 3) for p, h in zip(row["s"]["4 KiB pages"], row["s"]["huge pages"])]
            rows.append(row)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", default="0.25,1,4", help="comma-separated heap sizes in GiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--busy", type=int, default=0, help="processes spinning at nice +10 during the kills")
    ap.add_argument("--out", default="runs/bench/teardown.json")
    args = ap.parse_args()
    console = Console(stderr=True)
    sizes = [float(x) for x in args.gib.split(",") if x]
    rows = run(sizes, max(1, args.repeats), args.busy, console)
    t = Table(title=f"SIGKILL to the end of its socket's stream, by heap ({HUGETLB_TUNABLE}=1 against none)")
    for col in ("heap", "4 KiB pages (each, ms)", "huge pages (each, ms)", "huge / 4 KiB (each pair)",
                "MiB on huge pages (4 KiB / huge)"):
        t.add_column(col)
    for row in rows:
        plain, huge = row["s"]["4 KiB pages"], row["s"]["huge pages"]
        held = [max(row["huge_kib"][v]) >> 10 for v in ("4 KiB pages", "huge pages")]
        t.add_row(f"{row['gib']} GiB", ", ".join(f"{x * 1000:.1f}" for x in plain),
                  ", ".join(f"{x * 1000:.1f}" for x in huge),
                  f"{statistics.median(row['ratio']):.2f} ({', '.join(f'{x:.2f}' for x in row['ratio'])})",
                  f"{held[0]} / {held[1]}")  # with the kernel's THP at "always" the first is not 0
    Console(width=max(Console().width, 140), stderr=True).print(t)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python -m phalanx.bench teardown " + " ".join(sys.argv[1:]),
                               "rows": rows, "unix_s": time.time()}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
