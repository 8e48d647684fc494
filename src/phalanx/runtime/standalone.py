"""``phalanx coordinator``: the coordinator on its own, for multi-machine jobs."""

from __future__ import annotations

import json
import os
from pathlib import Path

from phalanx.collectives.process_group import RendezvousStore
from phalanx.core import event_loop
from phalanx.core.auth import read_token_file
from phalanx.membership.commit_log import COMMITS_FILE, CommitLogWriter
from phalanx.membership.coordinator import Coordinator, CoordinatorConfig
from phalanx.membership.quorum import QuorumConfig
from phalanx.transport.real_host import RealHost
from phalanx.transport.tcp import TcpTransport, TlsFiles, split_address


def run_coordinator(bind: str, token_file: str, workers: int, run_dir: Path) -> int:
    token = read_token_file(token_file)
    run_dir.mkdir(parents=True, exist_ok=True)
    return event_loop.run(_serve(bind, token, workers, run_dir))


async def _serve(bind: str, token: bytes, workers: int, run_dir: Path) -> int:
    host, _ = split_address(bind)
    store = RendezvousStore(host)  # on the bind address only, not every interface
    events = open(run_dir / "events.jsonl", "a", buffering=1)
    commit_log = CommitLogWriter(run_dir / COMMITS_FILE, append=True)  # every commit, as the launcher's
    cfg = CoordinatorConfig(quorum=QuorumConfig(expected_workers=workers), run_dir=str(run_dir))
    coord = Coordinator(RealHost("coordinator", TcpTransport(token, name="coordinator", tls=TlsFiles.from_env(dict(os.environ)))), cfg,
                        store.address, lambda ev: (events.write(json.dumps(ev) + "\n"), print(json.dumps(ev))),
                        on_commit=commit_log.incarnation())
    address = await coord.start(bind)
    print(f"phalanx coordinator listening on {address}", flush=True)
    await coord.all_done.wait()
    await coord.stop("all workers finished")
    commit_log.close()
    return 0
