"""Two real processes, ranks 0 and 1 of a script, meeting at a fresh TCPStore on loopback."""

import subprocess
import sys

import torch.distributed as dist


def run_two_ranks(script: str, timeout_s: float) -> list[tuple[int, str, str]]:
    """Run ``script`` (argv: rank, store address) as ranks 0 and 1; (exit code, stdout, stderr) of each."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{master.port}"
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), address], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=timeout_s) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]
