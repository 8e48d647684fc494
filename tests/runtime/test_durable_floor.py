"""The launcher's durable floor: what a restarted coordinator must stay above."""

from phalanx.runtime.launcher_faults import DurableFloor


def test_the_floor_only_rises_and_survives_a_new_reader(tmp_path):
    floor = DurableFloor(tmp_path)
    assert DurableFloor.read(tmp_path) == (0, -1, ())  # nothing written yet
    floor.raise_to(3)  # quorum_formed: an id, no committed step
    floor.raise_to(3, 17, ("w0", "w1"))
    floor.raise_to(2, 9, ("w2",))  # an older event changes nothing
    floor.raise_to(4)  # a newer id keeps the last commit and its members
    assert DurableFloor.read(tmp_path) == (4, 17, ("w0", "w1"))
    assert not list(tmp_path.glob("*.tmp"))  # replaced atomically


def test_an_unreadable_floor_reads_as_none_and_is_not_executed(tmp_path):
    (tmp_path / DurableFloor.FILE).write_text("__import__('os').system('false')")
    assert DurableFloor.read(tmp_path) == (0, -1, ())
    (tmp_path / DurableFloor.FILE).write_text('{"quorum_id": "x", "step": 1}')
    assert DurableFloor.read(tmp_path) == (0, -1, ())
    (tmp_path / DurableFloor.FILE).write_text('{"quorum_id": 2, "step": 1, "members": [1, 2]}')
    assert DurableFloor.read(tmp_path) == (0, -1, ())
