"""A launch's events: written to ``RUN/events.jsonl`` (``EventsWriter``) and read back from it
rather than kept twice (``EventLog``).

The launcher writes every event to events.jsonl, in batches at most ``FLUSH_S`` apart. It used to keep a
second copy of each in a list for ``LaunchResult.events``: one dict per committed step and more,
growing in the coordinator's process for the whole run. :class:`EventLog` reads the launch's part
of the file back on demand (from the offset where this launch began: a resumed run appends to the
same file), plus the few events that arrived after the file was closed. Like ``CommitHistory`` it
holds the file open, so it outlives a temporary run folder.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from phalanx.core.errors import PhalanxError
from phalanx.core.jsonl_batch import JsonLinesBatch

_CHUNK_BYTES = 1 << 20
FLUSH_S = 0.25  # an event on the launcher's loop reaches the file at most this much later
BATCH_MAX = 1024  # ... or once this many wait


class EventsWriter:
    """``RUN/events.jsonl`` as the launcher appends it. Events on the launcher's loop (the
    coordinator's, the supervisor's, the fault injector's) are kept as records and encoded and
    written together from a timer on that loop, at most ``FLUSH_S`` after the first of a batch: the
    coordinator's ``step_committed``, encoded and written one by one, sat between a step's last
    report and its decisions (docs/BENCHMARKS.md, session 32). An event from any other thread, or
    with no loop running, goes out at once, after what waits. ``close`` writes what waits."""

    def __init__(self, path: Path) -> None:
        self._f = open(path, "a", buffering=1)
        self._batch = JsonLinesBatch(self._put, FLUSH_S, BATCH_MAX)

    @property
    def closed(self) -> bool:
        return self._f.closed

    def write(self, ev: dict[str, Any]) -> None:
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        self._batch.add(ev, loop)
        if loop is None:
            self._batch.flush()

    def _put(self, lines: str) -> None:
        if not self._f.closed:
            self._f.write(lines)

    def close(self) -> None:
        self._batch.flush()
        self._f.close()


class EventLogError(PhalanxError):
    """An events.jsonl line is not a JSON object. Names the file and the line."""

    def __init__(self, path: Path | str, line: int, problem: str) -> None:
        self.path, self.line = str(path), line
        super().__init__(f"{path}:{line}: {problem}")


class EventLog:
    def __init__(self, path: Path, start_offset: int, late: list[dict[str, Any]]) -> None:
        self.path, self.start_offset, self.late = path, start_offset, late
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._fd = None

    def __del__(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)

    def _from_file(self) -> Iterator[dict[str, Any]]:
        if self._fd is None:
            return
        offset, rest, lineno = self.start_offset, b"", 0
        while chunk := os.pread(self._fd, _CHUNK_BYTES, offset):  # positioned: no offset shared between readers
            offset += len(chunk)
            *lines, rest = (rest + chunk).split(b"\n")
            for line in lines:
                lineno += 1
                if line.strip():
                    yield self._parse(line, lineno)
        if rest.strip():
            yield self._parse(rest, lineno + 1)

    def _parse(self, line: bytes, lineno: int) -> dict[str, Any]:
        try:
            ev = json.loads(line)
        except ValueError as e:  # UnicodeDecodeError included
            raise EventLogError(self.path, lineno, f"not a JSON event ({e}); counted from this launch's start") from e
        if not isinstance(ev, dict):
            raise EventLogError(self.path, lineno, "an event is a JSON object")
        return ev

    def __iter__(self) -> Iterator[dict[str, Any]]:
        yield from self._from_file()  # a generator: it holds self, so the file stays open while it runs
        yield from self.late

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __bool__(self) -> bool:
        return next(iter(self), None) is not None

    def __getitem__(self, i: int | slice) -> Any:
        return list(self)[i]
