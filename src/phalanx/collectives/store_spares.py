"""Rendezvous-store connections made before they are needed, so that a new quorum's group build
does not wait for one.

Each quorum's process group gets a store connection of its own (process_group.py says why). torch's
TCPStore client looks up a name for the address it connects to (a reverse DNS query for the
IPv4-mapped ``::ffff:a.b.c.d`` it tries first, which no hosts file lists) before every connect.
Where the resolver is slow or drops the query, that connect waits out the resolver's timeout:
5 s under glibc's defaults, measured on this project's machines once in 40-50 connects in bursts
(session 33). A build that connected then stalled every member of the new quorum with it, and a
kill's recovery with them. A spare made on a thread of its own, between builds, takes that wait
off the step's path; a build that finds no spare ready connects as before.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any


class StoreSpares:
    """Up to ``keep`` connected store clients, refilled on a daemon thread after each ``take``.

    ``connect`` makes one client (it blocks: a TCP connect, maybe a DNS wait). ``take`` never waits
    for a refill under way: it returns a spare if one is ready, else connects on the calling
    thread (a group build's own thread). ``discard`` drops the spares, e.g. after a build failed
    and the store may be gone: the next ``take`` connects afresh.
    """

    def __init__(self, connect: Callable[[], Any], keep: int = 1) -> None:
        self._connect = connect
        self._keep = keep
        self._ready: deque[Any] = deque()
        self._lock = threading.Lock()
        self._filling = False
        self._epoch = 0  # bumped by discard: a refill started before it is not kept
        self.connects_on_demand = 0  # takes that found no spare ready (tests and diagnostics)

    def offer(self, client: Any) -> None:
        """Keep an already connected client as a spare (e.g. the one made to check the store at join)."""
        with self._lock:
            if len(self._ready) < self._keep:
                self._ready.append(client)

    def take(self) -> Any:
        with self._lock:
            client = self._ready.popleft() if self._ready else None
        self.refill()
        if client is None:
            self.connects_on_demand += 1
            client = self._connect()
        return client

    def refill(self) -> None:
        """Start connecting a spare on a thread of its own unless enough are ready or one is on its way."""
        with self._lock:
            if self._filling or len(self._ready) >= self._keep:
                return
            self._filling = True
            epoch = self._epoch
        threading.Thread(target=self._fill, args=(epoch,), name="phalanx-store-spare", daemon=True).start()

    def _fill(self, epoch: int) -> None:
        try:
            client = self._connect()
        except Exception:  # the store is unreachable now: the next take connects, and says why
            client = None
        with self._lock:
            self._filling = False
            if client is not None and epoch == self._epoch and len(self._ready) < self._keep:
                self._ready.append(client)

    def discard(self) -> None:
        with self._lock:
            self._epoch += 1
            self._ready.clear()

    @property
    def ready(self) -> int:
        with self._lock:
            return len(self._ready)
