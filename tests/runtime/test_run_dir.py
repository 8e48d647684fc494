"""`--out DIR` removes only what a marker proves phalanx wrote; anything else is refused, untouched."""

import pytest

from phalanx.core.errors import ConfigError
from phalanx.runtime.run_dir import MARKER, claim_run_dir, clear_run_outputs
from phalanx.runtime.train_job import TrainOptions, run_train


def test_train_refuses_a_folder_of_user_files_and_deletes_nothing(tmp_path):
    home = tmp_path / "home"
    (home / "checkpoints").mkdir(parents=True)
    (home / "checkpoints" / "precious.bin").write_bytes(b"x")
    (home / "events.jsonl").write_text("mine\n")
    with pytest.raises(ConfigError, match="phalanx did not create it"):
        run_train(TrainOptions(workers=2, steps=2, run_dir=home, show_progress=False, report=False))
    assert (home / "checkpoints" / "precious.bin").read_bytes() == b"x"
    assert (home / "events.jsonl").read_text() == "mine\n"
    assert not (home / MARKER).exists()


def test_a_phalanx_run_folder_is_cleared_of_its_own_outputs_only(tmp_path):
    run = tmp_path / "run"
    claim_run_dir(run)
    (run / "workers").mkdir()
    (run / "workers" / "w0.jsonl").write_text("{}")
    (run / "events.jsonl").write_text("{}")
    (run / "final_w0.safetensors").write_bytes(b"x")
    (run / "notes.txt").write_text("the user's")
    clear_run_outputs(run)
    assert sorted(p.name for p in run.iterdir()) == [MARKER, "notes.txt"]


def test_a_link_in_a_run_folder_is_removed_never_followed(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("k")
    claim_run_dir(run)
    (run / "checkpoints").symlink_to(elsewhere)
    clear_run_outputs(run)
    assert (elsewhere / "keep.txt").read_text() == "k" and not (run / "checkpoints").exists()


def test_an_empty_folder_is_adopted_and_a_file_is_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    claim_run_dir(empty)
    assert (empty / MARKER).exists()
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="not a folder"):
        claim_run_dir(f)


def test_clearing_a_folder_without_the_marker_is_refused(tmp_path):
    (tmp_path / "events.jsonl").write_text("mine")
    with pytest.raises(ConfigError, match="removes nothing"):
        clear_run_outputs(tmp_path)
    assert (tmp_path / "events.jsonl").read_text() == "mine"
