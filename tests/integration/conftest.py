import json
from pathlib import Path

import pytest

from phalanx.faults.plan import parse_fault_plan
from phalanx.runtime.train_job import TrainOptions, run_train


def train(tmp_path: Path, plan: str = "", workers: int = 3, steps: int = 40, name: str = "run", **kw) -> dict:
    opts = TrainOptions(workers=workers, steps=steps, run_dir=tmp_path / name,
                        fault_plan=parse_fault_plan(plan, "<test>") if plan else None, show_progress=False,
                        checkpoint_every_steps=kw.pop("checkpoint_every_steps", 0),
                        report=kw.pop("report", False), **kw)  # the report has its own tests
    return run_train(opts)


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def assert_strict(summary: dict) -> None:
    """The strict-mode guarantees every fault test ends with."""
    assert summary["ok"], summary.get("reason")
    assert summary["steps_committed"] >= 1
    assert summary["samples_exactly_once"] is True
    assert summary["reference_max_abs_diff"] is not None and summary["reference_max_abs_diff"] <= 1e-5, summary


@pytest.fixture
def run_train_job():
    return train
