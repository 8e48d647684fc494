"""The launcher's durable floor: what a restarted coordinator must stay above."""

from phalanx.runtime.launcher import DurableFloor


def test_the_floor_only_rises_and_survives_a_new_reader(tmp_path):
    floor = DurableFloor(tmp_path)
    assert DurableFloor.read(tmp_path) == (0, -1)  # nothing written yet
    floor.raise_to(3, -1)  # quorum_formed carries no step
    floor.raise_to(3, 17)
    floor.raise_to(2, 9)  # an older event changes nothing
    assert DurableFloor.read(tmp_path) == (3, 17)
    assert not list(tmp_path.glob("*.tmp"))  # replaced atomically


def test_an_unreadable_floor_reads_as_none_and_is_not_executed(tmp_path):
    (tmp_path / DurableFloor.FILE).write_text("__import__('os').system('false')")
    assert DurableFloor.read(tmp_path) == (0, -1)
    (tmp_path / DurableFloor.FILE).write_text('{"quorum_id": "x", "step": 1}')
    assert DurableFloor.read(tmp_path) == (0, -1)
