"""The commit history: a bounded ring in the coordinator, the full log in ``RUN/commits.jsonl``.

The coordinator keeps only its last ``CoordinatorConfig.commits_kept`` records in memory and hands
every record to a sink (``on_commit``) as it commits, before the decision leaves the process. A
real run's sink is :class:`CommitLogWriter`: one JSON line per record, appended and flushed per
record, written only by the process that runs the coordinator. The simulator's sink keeps them in
a list (or writes the same file when asked). Everything that needs the whole history at the end
(metrics.jsonl, the exactly-once tally, summaries) streams it back with :func:`read_commits`.

One file spans coordinator incarnations: every line names the incarnation that wrote it, and each
incarnation's records go up by one step. A crash can fall after an incarnation recorded a commit but
before any worker heard of it: every worker then rolls that step back and the next incarnation
commits it again. Both decisions are in the log (each was made once); the later is the one the
workers acted on, so the merged history (:func:`read_commits`, :func:`merge_commits`) keeps it and
lists the earlier as superseded.

The file is input when read back: each line is parsed as JSON and checked field by field, and a
malformed one raises :class:`CommitLogError` naming the file and the line (never eval, never pickle).
This module does no I/O of its own at commit time beyond the writer a driver hands the coordinator.
"""

from __future__ import annotations

import math
import os
from itertools import islice
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, overload

import msgspec

from phalanx.core.errors import PhalanxError
from phalanx.membership.coordinator_state import CommitRecord

__all__ = ["COMMITS_FILE", "CommitHistory", "CommitLogError", "CommitLogWriter", "CommitRecord", "commit_json",
           "merge_commits", "read_commits", "read_log", "read_superseded"]

COMMITS_FILE = "commits.jsonl"



class CommitLogError(PhalanxError):
    """A commit log line is not a valid commit record, or breaks the log's order. Names file and line."""

    def __init__(self, path: Path | str, line: int, problem: str) -> None:
        self.path, self.line, self.problem = str(path), line, problem
        super().__init__(f"{path}:{line}: {problem} (the commit log is written by phalanx only; "
                         "restore it from a backup or rerun the job)")


def commit_json(c: CommitRecord) -> dict[str, Any]:
    """A record as metrics.jsonl and the simulator's results spell it (key order included)."""
    return {"step": c.step, "quorum_id": c.quorum_id, "members": list(c.members), "loss": c.loss,
            "step_s": c.step_s, "committed_at_s": c.committed_at_s, "samples_covered_once": c.covered_once}


def merge_commits(incarnations: list[list[CommitRecord]]) -> tuple[list[CommitRecord], list[CommitRecord]]:
    """One commit list over coordinator incarnations (oldest first), and the records superseded.

    A crash can fall after the coordinator recorded a commit but before any worker heard of it:
    every worker then rolls that step back and the next incarnation commits it again. The later
    record is the one the workers acted on, so it replaces the earlier one.
    """
    merged: list[CommitRecord] = []
    superseded: list[CommitRecord] = []
    for commits in incarnations:
        if commits:
            first = commits[0].step
            superseded += [c for c in merged if c.step >= first]
            merged = [c for c in merged if c.step < first]
        merged += commits
    steps = [c.step for c in merged]
    assert steps == sorted(set(steps)), f"commits across coordinator incarnations go up by one: {steps[:20]}"
    return merged, superseded


# ---- writing ----
class CommitLogWriter:
    """Appends every commit record to ``path`` as one JSON line, flushed per record (a write into
    the page cache, a few microseconds: no fsync on the commit path). One writer per run, held by
    the launcher process across coordinator incarnations: :meth:`incarnation` gives each new
    coordinator its sink. ``append`` continues an existing log (a resumed launch): its incarnations
    are numbered after the ones already there, which are validated first."""

    def __init__(self, path: Path, append: bool = False) -> None:
        self.path = path
        last = -1
        if append and path.exists():
            for inc, _, _ in read_log(path):
                last = inc
        self.first_incarnation = last + 1
        self._next = last + 1
        self.records_written = 0
        self._file = open(path, "a" if append else "w", encoding="utf-8")

    def incarnation(self, shift_s: float = 0.0) -> Callable[[CommitRecord], None]:
        """The sink for the next coordinator incarnation. ``shift_s``: its clock's start after the
        first incarnation's; ``committed_at_s`` is written on the first incarnation's axis."""
        inc = self._next
        self._next += 1

        def append(c: CommitRecord) -> None:
            assert inc == self._next - 1, "a crashed coordinator commits nothing after its successor started"
            if self._file.closed:
                return  # the run is over and its history was read: a late decision reached no worker
            line = {**commit_json(c), "incarnation": inc}
            if shift_s:
                line["committed_at_s"] = round(c.committed_at_s + shift_s, 6)
            self._file.write(_ENCODE(line).decode() + "\n")
            self._file.flush()
            self.records_written += 1

        return append

    def history(self) -> CommitHistory:
        """This writer's incarnations, merged (a resumed launch's earlier records are not in it)."""
        return CommitHistory(self.path, self.first_incarnation)

    def close(self) -> None:
        self._file.close()


# ---- reading ----
class _Line(msgspec.Struct, forbid_unknown_fields=True):
    """One log line as written: decoded strictly (types, ranges, no missing or unknown field)."""

    step: Annotated[int, msgspec.Meta(ge=0)]
    quorum_id: Annotated[int, msgspec.Meta(ge=0)]
    members: list[str]
    loss: float | None  # null: not a number (a diverged run is recorded as it was)
    step_s: float
    committed_at_s: float
    samples_covered_once: bool
    incarnation: Annotated[int, msgspec.Meta(ge=0)]


_DECODE = msgspec.json.Decoder(_Line).decode
_ENCODE = msgspec.json.Encoder().encode  # a NaN loss is written as null (JSON has no NaN)


def _parse(text: bytes) -> tuple[int, CommitRecord]:
    x = _DECODE(text)  # JSON has no NaN or infinity, and msgspec refuses a number out of range
    loss = math.nan if x.loss is None else x.loss
    return x.incarnation, CommitRecord(x.step, x.quorum_id, tuple(x.members), loss, x.committed_at_s, x.step_s,
                                       x.samples_covered_once)


_CHUNK_BYTES = 1 << 20


def _raw_lines(path: Path, fd: int | None) -> Iterator[bytes]:
    """The file's lines as bytes. From ``fd`` (held open, so readable even after the run folder was
    removed) with positioned reads, which share no offset with another reader of the same fd."""
    if fd is None:
        with open(path, "rb") as f:
            yield from f
        return
    offset, rest = 0, b""
    while chunk := os.pread(fd, _CHUNK_BYTES, offset):
        offset += len(chunk)
        *lines, rest = (rest + chunk).split(b"\n")
        for line in lines:
            yield line + b"\n"
    if rest:
        yield rest


def read_log(path: Path, fd: int | None = None) -> Iterator[tuple[int, int, CommitRecord]]:
    """Every line of the log as written, streamed: (incarnation, line number, record). Checks each
    line, and that incarnations never go back and each incarnation's steps go up by one."""
    last: tuple[int, int] | None = None  # (incarnation, step) of the line before
    for lineno, raw in enumerate(_raw_lines(path, fd), 1):
        if not raw.strip():
            continue
        if not raw.endswith(b"\n"):
            raise CommitLogError(path, lineno, "the last record is cut short (the writer died mid-line)")
        try:
            inc, rec = _parse(raw)
        except (ValueError, msgspec.DecodeError) as e:  # msgspec.ValidationError is a DecodeError
            raise CommitLogError(path, lineno, f"not a commit record: {e}") from e
        if last is not None and inc < last[0]:
            raise CommitLogError(path, lineno, f"incarnation {inc} after incarnation {last[0]}")
        if last is not None and inc == last[0] and rec.step != last[1] + 1:
            raise CommitLogError(path, lineno, f"step {rec.step} after step {last[1]} in incarnation {inc}: "
                                               "an incarnation commits each step once, in order")
        last = (inc, rec.step)
        yield inc, lineno, rec


def _survival_bounds(path: Path, first_incarnation: int, fd: int | None = None) -> dict[int, float]:
    """Per incarnation, the lowest first step of any later one: its records at or above it were
    committed again later (superseded). One streaming pass; memory O(incarnations)."""
    firsts: dict[int, int] = {}
    for inc, _, rec in read_log(path, fd):
        if inc >= first_incarnation:
            firsts.setdefault(inc, rec.step)
    bounds: dict[int, float] = {}
    later = math.inf
    for inc in sorted(firsts, reverse=True):
        bounds[inc] = later
        later = min(later, firsts[inc])
    return bounds


def _split(path: Path, first_incarnation: int, keep: bool,
           bounds: dict[int, float] | None = None, fd: int | None = None) -> Iterator[CommitRecord]:
    if fd is None and not path.exists():
        return
    if bounds is None:
        bounds = _survival_bounds(path, first_incarnation, fd)
    last_step = -1
    for inc, lineno, rec in read_log(path, fd):
        if inc < first_incarnation:
            continue
        survives = rec.step < bounds.get(inc, math.inf)  # begun after the bounds were read: nothing later
        if survives and keep:
            if rec.step <= last_step:
                raise CommitLogError(path, lineno, f"step {rec.step} after step {last_step} in the merged history")
            last_step = rec.step
            yield rec
        elif not survives and not keep:
            yield rec


def read_commits(path: Path, first_incarnation: int = 0) -> Iterator[CommitRecord]:
    """The merged history, streamed in step order: each step's decision that stuck, once."""
    return _split(path, first_incarnation, keep=True)


def read_superseded(path: Path, first_incarnation: int = 0) -> Iterator[CommitRecord]:
    """Decisions that died with their coordinator before any worker acted on them (redone later)."""
    return _split(path, first_incarnation, keep=False)


class CommitHistory:
    """A run's merged commit history, read from its log on demand rather than held in memory.
    Iterating streams the file; ``len``, the last record and slices are there for the callers that
    used the in-memory list (``history[-1].loss``, ``history[5:]``). The file is held open from
    construction, so a history outlives its run folder (a benchmark's temporary one); a file that
    did not exist then is an empty history."""

    def __init__(self, path: Path, first_incarnation: int = 0) -> None:
        self.path, self.first_incarnation = path, first_incarnation
        self._len: int | None = None
        self._last: CommitRecord | None = None
        self._bounds: dict[int, float] | None = None  # read once: the log is complete when a history is read
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._fd = None

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)

    def _survival(self) -> dict[int, float]:
        if self._bounds is None:
            self._bounds = _survival_bounds(self.path, self.first_incarnation, self._fd) if self._fd is not None else {}
        return self._bounds

    def __iter__(self) -> Iterator[CommitRecord]:
        if self._fd is not None:  # a generator: it holds self, so the fd stays open while it runs
            yield from _split(self.path, self.first_incarnation, True, self._survival(), self._fd)

    def _scan(self) -> None:
        n, last = 0, None
        for rec in self:
            n, last = n + 1, rec
        self._len, self._last = n, last

    def __len__(self) -> int:
        if self._len is None:
            self._scan()
        assert self._len is not None
        return self._len

    def __bool__(self) -> bool:
        return len(self) > 0

    @overload
    def __getitem__(self, i: int) -> CommitRecord: ...
    @overload
    def __getitem__(self, i: slice) -> list[CommitRecord]: ...
    def __getitem__(self, i: int | slice) -> CommitRecord | list[CommitRecord]:
        if isinstance(i, slice):
            if (i.start or 0) >= 0 and (i.stop is None or i.stop >= 0) and (i.step or 1) > 0:
                return list(islice(self, i.start, i.stop, i.step))  # streamed: holds only what it returns
            return list(self)[i]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("commit history index out of range")
        if i == n - 1:
            assert self._last is not None
            return self._last
        return next(rec for k, rec in enumerate(self) if k == i)

    def superseded(self) -> list[CommitRecord]:
        if self._fd is None:
            return []
        return list(_split(self.path, self.first_incarnation, False, self._survival(), self._fd))
