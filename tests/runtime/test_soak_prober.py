"""The soak's prober learns the ports to attack from events.jsonl, reading only what was appended
since its last look (the file grows for the whole soak)."""

import json

from phalanx.runtime.soak import Prober


def _line(**ev) -> str:
    return json.dumps(ev) + "\n"


def test_the_prober_reads_new_events_only_and_waits_for_a_line_still_being_written(tmp_path):
    path = tmp_path / "events.jsonl"
    p = Prober(tmp_path)
    assert p.targets() == []  # no file yet
    path.write_text(_line(event="coordinator_started", address="127.0.0.1:5000") + _line(event="step_committed"))
    assert p.targets() == ["127.0.0.1:5000"]
    offset = p._offset
    partial = _line(event="worker_joined", heal_address="127.0.0.1:6001")
    with open(path, "a") as f:
        f.write(partial[:20])
    assert p.targets() == ["127.0.0.1:5000"] and p._offset == offset  # the half line is not consumed
    with open(path, "a") as f:
        f.write(partial[20:] + "garbage\n")
    assert p.targets() == ["127.0.0.1:5000", "127.0.0.1:6001"]
    assert p._offset == path.stat().st_size


def test_the_prober_forgets_an_earlier_runs_ports_when_the_file_is_replaced(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(_line(event="coordinator_started", address="127.0.0.1:5000") * 50)
    p = Prober(tmp_path)
    assert p.targets() == ["127.0.0.1:5000"]
    path.unlink()
    path.write_text(_line(event="coordinator_started", address="127.0.0.1:7000"))
    assert p.targets() == ["127.0.0.1:7000"]
