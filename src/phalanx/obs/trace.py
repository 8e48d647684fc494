"""Chrome trace event JSON for a run, so one run can be opened in Perfetto (ui.perfetto.dev) or chrome://tracing.

Worker spans carry ``mono`` (the host's monotonic clock, shared by every process on the machine), coordinator events
carry ``t`` (seconds since the coordinator started) and sometimes ``mono`` too. Everything is put on one time axis in
microseconds from the earliest instant of the run, so a fault on the coordinator track lines up with the stalled
allreduce on the worker tracks beneath it.

Track layout is fixed so traces of different runs look alike: pid 0 is the coordinator (tid 0 coordinator events and
step commits, tid 1 launcher events), worker ``wN`` is pid N+1 (tid 0 the step loop, tid 1 healing and checkpoints,
which may overlap the step loop, e.g. a healthy peer serving state while it waits for the quorum).
"""

from __future__ import annotations

import re
import statistics
from typing import Any

Record = dict[str, Any]

COORDINATOR_PID = 0
_US_PER_S = 1_000_000.0
_SIDE_SPANS = frozenset({"heal", "heal_serve", "restore", "checkpoint"})
_WORKER_NAME = re.compile(r"^w(\d+)$")
# fields that are already expressed by the event's position on the trace; everything else goes into args
_PLACEMENT_KEYS = frozenset({"mono", "dur", "t", "node", "span", "event"})
# a span that ends this little after the next one on its thread starts is clock rounding, not concurrency
_ROUNDING_OVERLAP_US = 1000.0


def worker_pids(names: list[str]) -> dict[str, int]:
    """``wN`` -> N+1; other names get the numbers after the highest, in sorted order, so pids are stable."""
    pids: dict[str, int] = {}
    for name in names:
        m = _WORKER_NAME.match(name)
        if m:
            pids[name] = int(m.group(1)) + 1
    next_pid = max(pids.values(), default=0) + 1
    for name in sorted(n for n in names if n not in pids):
        pids[name] = next_pid
        next_pid += 1
    return pids


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def coordinator_offset_s(events: list[Record], workers: dict[str, list[Record]]) -> float:
    """The value to add to an event's ``t`` to get a ``mono``.

    Best: events that carry both clocks (the launcher writes both). Otherwise coordinator_started (t=0) is pinned to the
    earliest worker instant, which is roughly right because workers start right after the coordinator. With no worker
    files at all there is nothing to align to, so ``t`` is used as is.
    """
    both = [e["mono"] - e["t"] for e in events if _is_number(e.get("mono")) and _is_number(e.get("t"))]
    if both:
        return statistics.median(both)
    worker_monos = [r["mono"] for recs in workers.values() for r in recs if _is_number(r.get("mono"))]
    if not worker_monos:
        return 0.0
    started_t = next((e["t"] for e in events if e.get("event") == "coordinator_started" and _is_number(e.get("t"))),
                     0.0)
    return min(worker_monos) - started_t


def _event_mono(event: Record, offset_s: float) -> float | None:
    if _is_number(event.get("mono")):
        return float(event["mono"])
    if _is_number(event.get("t")):
        return float(event["t"]) + offset_s
    return None


def _args(record: Record) -> Record:
    return {k: v for k, v in record.items() if k not in _PLACEMENT_KEYS}


def _metadata(pid: int, process: str, threads: dict[int, str]) -> list[Record]:
    out: list[Record] = [{"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": process}},
                         {"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}}]
    out += [{"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}
            for tid, name in threads.items()]
    return out


def _worker_events(pid: int, records: list[Record], base_s: float) -> list[Record]:
    """Spans become complete ("X") events, instants become "i" events; records without a clock are dropped."""
    out: list[Record] = []
    for r in records:
        if not _is_number(r.get("mono")):
            continue
        ts_us = (r["mono"] - base_s) * _US_PER_S
        if isinstance(r.get("span"), str):
            dur_s = r["dur"] if _is_number(r.get("dur")) else 0.0
            tid = 1 if r["span"] in _SIDE_SPANS else 0
            out.append({"ph": "X", "name": r["span"], "cat": "worker", "pid": pid, "tid": tid, "ts": ts_us,
                        "dur": max(dur_s, 0.0) * _US_PER_S, "args": _args(r)})
        elif isinstance(r.get("event"), str):
            out.append({"ph": "i", "s": "t", "name": r["event"], "cat": "worker", "pid": pid, "tid": 0,
                        "ts": ts_us, "args": _args(r)})
    _trim_rounding_overlaps([e for e in out if e["ph"] == "X" and e["tid"] == 0])
    return out


def _trim_rounding_overlaps(spans: list[Record]) -> None:
    """End a span where the next one starts when they overlap by microseconds.

    Workers time each phase separately, so compute can end a few microseconds after the allreduce that follows it
    "began". Trace viewers treat such partial overlaps as mis-nested slices and may drop them.
    """
    spans.sort(key=lambda e: e["ts"])
    for a, b in zip(spans, spans[1:]):
        a_end_us = a["ts"] + a["dur"]
        if a["ts"] <= b["ts"] < a_end_us < b["ts"] + b["dur"] and a_end_us - b["ts"] <= _ROUNDING_OVERLAP_US:
            a["dur"] = b["ts"] - a["ts"]


def _coordinator_events(events: list[Record], offset_s: float, base_s: float) -> list[Record]:
    """Instants for every event, plus a span per committed step from the previous commit (or start) to this one."""
    out: list[Record] = []
    prev_commit_us: float | None = None
    for e in events:
        mono = _event_mono(e, offset_s)
        name = e.get("event")
        if mono is None or not isinstance(name, str):
            continue
        ts_us = (mono - base_s) * _US_PER_S
        tid = 1 if e.get("node") == "launcher" else 0
        if name == "step_committed":
            start_us = prev_commit_us if prev_commit_us is not None else ts_us - _step_s(e) * _US_PER_S
            out.append({"ph": "X", "name": f"step {e.get('step')}", "cat": "commit", "pid": COORDINATOR_PID,
                        "tid": 0, "ts": max(start_us, 0.0), "dur": max(ts_us - max(start_us, 0.0), 0.0),
                        "args": _args(e)})
            prev_commit_us = ts_us
        elif name == "coordinator_started":
            prev_commit_us = ts_us
        out.append({"ph": "i", "s": "t", "name": name, "cat": str(e.get("node", "coordinator")),
                    "pid": COORDINATOR_PID, "tid": tid, "ts": ts_us, "args": _args(e)})
    return out


def _step_s(event: Record) -> float:
    return float(event["step_s"]) if _is_number(event.get("step_s")) else 0.0


def _base_mono_s(events: list[Record], workers: dict[str, list[Record]], offset_s: float) -> float:
    """The earliest instant in the run, so every ``ts`` is non-negative."""
    times = [r["mono"] for recs in workers.values() for r in recs if _is_number(r.get("mono"))]
    times += [m for m in (_event_mono(e, offset_s) for e in events) if m is not None]
    return min(times, default=0.0)


def build_trace(events: list[Record], workers: dict[str, list[Record]]) -> Record:
    """The whole run as a Chrome trace document: ``{"traceEvents": [...], "displayTimeUnit": "ms"}``."""
    offset_s = coordinator_offset_s(events, workers)
    base_s = _base_mono_s(events, workers, offset_s)
    trace: list[Record] = _metadata(COORDINATOR_PID, "coordinator", {0: "coordinator", 1: "launcher"})
    body = _coordinator_events(events, offset_s, base_s)
    for name, pid in sorted(worker_pids(list(workers)).items(), key=lambda kv: kv[1]):
        trace += _metadata(pid, name, {0: f"{name} steps", 1: f"{name} heal/checkpoint"})
        body += _worker_events(pid, workers[name], base_s)
    for ev in body:
        ev["ts"] = round(ev["ts"], 3)
        if "dur" in ev:
            ev["dur"] = round(ev["dur"], 3)
    body.sort(key=lambda ev: (ev["ts"], ev["pid"], ev["tid"]))
    return {"traceEvents": trace + body, "displayTimeUnit": "ms",
            "otherData": {"clock": "microseconds since the earliest instant of the run",
                          "coordinator_mono_offset_s": offset_s}}
