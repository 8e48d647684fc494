"""A user's loop that raises between the commit and the optimizer step (real processes).

A commit that hands the next step's ticket tells the engine the step's result on the control
loop, so the user's thread sends nothing more for that step (train/thread_body.py, ``ThreadBody.send_vote``).
What the user's code does afterwards must still reach the engine: a raise ends this worker's
job (Goodbye, not completed) and its peer goes on alone and finishes; nothing hangs. The peer's
process exits 0: it ended while its abandoned group (the one w1 left) was still held by the thread
that drops it, and it used to die of SIGABRT there ("terminate called without an active exception",
collectives/group_teardown.py ``drop_on_thread``)."""

from __future__ import annotations

import sys
from pathlib import Path

from phalanx.runtime.launcher import LaunchConfig, launch

SCRIPT = """
import torch, phalanx
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
job = phalanx.join()
job.track(model=model, optimizer=opt)
for step in job.steps(12):
    idx = step.shard(96, 24)
    loss = model(torch.randn(len(idx), 8)).pow(2).mean()
    loss.backward()
    step.allreduce_gradients(model, loss=loss)  # False on the step after w1 left: it is retried
    if step.number == 4 and job.worker_id == "w1":
        raise RuntimeError("user code failed after the commit")
    opt.step()
    opt.zero_grad()
"""


def test_a_raise_after_a_commit_ends_that_worker_and_its_peer_finishes(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    res = launch(LaunchConfig(argv=[sys.executable, str(script)], workers=2, run_dir=tmp_path / "run",
                              show_progress=False, max_wall_s=120.0, stall_timeout_s=30.0))
    finished = {e["worker"]: e for e in res.events if e.get("event") == "worker_finished"}
    assert finished["w1"]["completed"] is False
    assert finished["w1"]["reason"] == "loop body raised or exited early"
    assert finished["w0"]["completed"] is True  # it went on alone
    exits = {e["worker"]: e["exit_code"] for e in res.events if e.get("event") == "worker_exited"}
    assert exits == {"w0": 0, "w1": 1}
    steps = [c.step for c in res.commits]
    assert steps[-1] == 11 and 4 in steps  # step 4 committed (both voted), then w0 alone to the end
    assert not res.ok and "; w1 exited without finishing" in res.reason
    assert "user code failed after the commit" in (tmp_path / "run" / "workers" / "w1.log").read_text()
