"""Records kept in memory and written as JSON lines together, from a timer on an event loop.

The worker's span log and the launcher's ``events.jsonl`` record something on every step, right
where a step waits (after a verdict, between a report and its decision): encoding and writing each
line there held the GIL or delayed the decision (docs/BENCHMARKS.md, session 32). A
``JsonLinesBatch`` keeps the records and encodes and writes them in one go, at most ``flush_s``
after the first of a batch (a timer set by the first record added on a running loop's own thread),
once ``max_records`` wait, or when its owner flushes it (close, exit).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any


class JsonLinesBatch:
    def __init__(self, put: Callable[[str], None], flush_s: float, max_records: int) -> None:
        self._put = put  # writes the encoded lines (the owner's file)
        self.flush_s, self.max_records = flush_s, max_records
        self._lock = threading.Lock()  # records may be added from several threads
        self._records: list[dict[str, Any]] = []
        self._armed = False  # the timer is set

    def add(self, record: dict[str, Any], loop: asyncio.AbstractEventLoop | None) -> None:
        """Keep ``record``. ``loop``: the caller's running loop, given only on that loop's own thread
        (only it may set the loop's timers); None leaves the batch to the next caller with one."""
        with self._lock:
            self._records.append(record)
            n, arm = len(self._records), loop is not None and not self._armed
            self._armed = self._armed or arm
        if arm:
            assert loop is not None
            loop.call_later(self.flush_s, self.flush)
        if n >= self.max_records:
            self.flush()

    def flush(self) -> None:
        """Encode and write what waits (the lock is not held while writing)."""
        with self._lock:
            records, self._records, self._armed = self._records, [], False
        if records:
            self._put("".join(json.dumps(r) + "\n" for r in records))
