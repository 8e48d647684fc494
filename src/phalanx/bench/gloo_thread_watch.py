"""Which worker processes' Gloo threads burn CPU during a real run, sampled from Linux /proc (the
fidelity benchmark's diagnostic; on other systems it sees nothing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class GlooThreadWatch:
    """Samples, every ``interval_s`` while a real run goes, the CPU time of each worker process's Gloo
    threads (Linux /proc; nothing elsewhere). Session 15 saw a quorum's Gloo group, abandoned after a
    peer was killed and held in the graveyard, spin one ``gloo_tcp_loop`` thread at 25-94 % of a core
    in one survivor for 5-11 s, and that worker take its commit decisions ~15 ms late meanwhile."""

    def __init__(self, module: str = "phalanx.workload.charlm_train", interval_s: float = 1.0) -> None:
        import threading

        self.module, self.interval_s = module, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gloo-thread-watch", daemon=True)
        # (pid, worker) -> {tid: cpu ticks}, and the busiest single thread's peak ticks per interval
        self._ticks: dict[tuple[str, str], dict[str, int]] = {}
        self._peak: dict[tuple[str, str], int] = {}

    def __enter__(self) -> "GlooThreadWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _workers(self) -> list[tuple[str, str]]:
        out = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                argv = cmdline.read_bytes().split(b"\0")
                if argv[1:3] != [b"-m", self.module.encode()]:
                    continue
                env = (cmdline.parent / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError):
                continue
            wid = next((e[len(b"PHALANX_WORKER_ID="):].decode() for e in env if e.startswith(b"PHALANX_WORKER_ID=")), "?")
            out.append((cmdline.parent.name, wid))
        return out

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            for pid, wid in self._workers():
                now: dict[str, int] = {}
                for task in Path(f"/proc/{pid}/task").glob("*"):
                    try:
                        if not (task / "comm").read_text().startswith(("gloo", "pt_gloo")):
                            continue
                        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                        now[task.name] = int(fields[11]) + int(fields[12])  # utime + stime
                    except (OSError, IndexError, ValueError):
                        continue
                before = self._ticks.get((pid, wid), {})
                step = max((t - before.get(tid, t) for tid, t in now.items()), default=0)
                self._peak[(pid, wid)] = max(self._peak.get((pid, wid), 0), step)
                self._ticks[(pid, wid)] = {**before, **now}

    def summary(self) -> list[dict[str, Any]]:
        """Per worker process: its Gloo threads' CPU seconds, and the busiest one's peak share of a core."""
        import os

        hz = os.sysconf("SC_CLK_TCK")
        return [{"worker": wid, "pid": int(pid), "gloo_cpu_s": sum(t.values()) / hz,
                 "busiest_gloo_thread_peak_core": self._peak.get((pid, wid), 0) / hz / self.interval_s}
                for (pid, wid), t in sorted(self._ticks.items(), key=lambda kv: int(kv[0][0]))]
