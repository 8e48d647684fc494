"""charlm_train --no-overlap (the latency experiment's real point) reaches job.track as overlap=False."""

import sys
from types import SimpleNamespace

import pytest
import torch

import phalanx
from phalanx.workload import charlm_train


class _RecordingJob:
    """Just enough of phalanx.join()'s Job for the script to run zero steps."""

    def __init__(self, run_dir):
        self.run_dir, self.worker_id, self.counters = run_dir, "w0", SimpleNamespace(steps_committed=0)
        self.tracked = {}

    def track(self, model, optimizer=None, **kwargs):
        self.tracked = kwargs

    def steps(self, total):
        return iter(())

    def save_final(self):
        pass

    def close(self):
        pass


@pytest.mark.parametrize(("argv", "overlap"), [([], True), (["--no-overlap"], False)])
def test_no_overlap_flag_turns_bucketed_overlap_off_in_job_track(tmp_path, monkeypatch, argv, overlap):
    (tmp_path / "workers").mkdir()
    job = _RecordingJob(tmp_path)
    monkeypatch.setattr(phalanx, "join", lambda: job)
    monkeypatch.setattr(sys, "argv", ["charlm_train", "--steps", "0", *argv])
    threads = torch.get_num_threads()
    try:
        charlm_train.main()
    finally:
        torch.set_num_threads(threads)  # the script pins one thread; leave the test process as it was
    assert job.tracked.get("overlap") is overlap
