"""A launch's events come back from events.jsonl (this launch's part of it, then any that came
after it was closed) instead of a second in-memory copy that grew for the whole run."""

import json

import pytest

from phalanx.runtime import event_log
from phalanx.runtime.event_log import EventLog, EventLogError


def _lines(evs):
    return "".join(json.dumps(e) + "\n" for e in evs)


def test_the_log_reads_this_launchs_events_then_the_late_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(event_log, "_CHUNK_BYTES", 64)  # events split across reads
    path = tmp_path / "events.jsonl"
    earlier = _lines([{"event": "from_the_run_before", "i": i} for i in range(5)])
    mine = [{"event": "step_committed", "step": i, "members": ["w0", "w1"], "t": 0.1 * i} for i in range(40)]
    path.write_text(earlier + _lines(mine))
    late = [{"event": "worker_exited", "worker": "w1"}]
    log = EventLog(path, len(earlier.encode()), late)
    path.unlink()  # held open: a temporary run folder may go first
    assert list(log) == mine + late and len(log) == 41 and log[-1] == late[0] and log
    assert [e["step"] for e in log if e["event"] == "step_committed"][-3:] == [37, 38, 39]


def test_an_empty_or_missing_log_is_empty(tmp_path):
    assert list(EventLog(tmp_path / "none.jsonl", 0, [])) == [] and not EventLog(tmp_path / "none.jsonl", 0, [])


def test_a_line_that_is_not_a_json_object_is_a_typed_error_naming_the_line(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(_lines([{"event": "a"}]) + "[1]\n")
    with pytest.raises(EventLogError, match=r"events.jsonl:2: an event is a JSON object"):
        list(EventLog(path, 0, []))
    path.write_bytes(b'{"event": "a"}\n{"cut')
    with pytest.raises(EventLogError, match=r":2: not a JSON event"):
        list(EventLog(path, 0, []))


def test_events_on_the_loop_are_written_in_a_batch_within_flush_s_and_all_by_close(tmp_path):
    import asyncio

    from phalanx.runtime.event_log import EventsWriter

    path = tmp_path / "events.jsonl"
    w = EventsWriter(path)

    async def main():
        w.write({"event": "a"})
        w.write({"event": "b"})
        assert path.read_text() == ""  # waiting for the batch
        await asyncio.sleep(event_log.FLUSH_S + 0.1)
        assert [json.loads(x)["event"] for x in path.read_text().splitlines()] == ["a", "b"]
        w.write({"event": "c"})

    asyncio.run(main())
    w.write({"event": "d"})  # no loop running: after what waits, at once
    assert [json.loads(x)["event"] for x in path.read_text().splitlines()] == ["a", "b", "c", "d"]
    w.close()
    assert w.closed
