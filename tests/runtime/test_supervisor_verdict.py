"""The launcher's verdict on how its workers ended: a worker the fault plan killed for good
(`restart = false`) departed, it did not fail, as the simulator's Cluster counts it; a run in
which nobody finished is never "all finished"."""

from __future__ import annotations

import pytest

from phalanx.runtime.supervisor import Supervisor


@pytest.mark.parametrize("why, ends, joiners, expected", [
    ("everyone exited 0", ["finished", "finished", "finished"], (), True),
    ("one killed for good by the plan", ["finished", "finished", "departed"], (), True),
    ("one exited 1", ["finished", "failed", "finished"], (), False),
    ("everyone killed for good", ["departed", "departed", "departed"], (), False),
    ("one still to join has not finished, and does not count", ["finished", "finished", "none"], (2,), True),
    ("one still running", ["finished", "finished", "none"], (), False),
])
def test_all_finished(tmp_path, why, ends, joiners, expected):
    sup = Supervisor(["true"], {}, tmp_path, len(ends), restart_failed=False, joiners=frozenset(joiners))
    for w, end in zip(sup.workers, ends):
        w.finished, w.departed = end == "finished", end == "departed"
    assert sup.all_finished() is expected, why
