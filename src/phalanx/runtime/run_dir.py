"""Run folders: phalanx removes only what a marker file proves it wrote.

``phalanx train --out DIR`` clears an earlier run's outputs before a fresh run, so logs are not
appended to the old run's and old checkpoints are not restored. It must never delete what it did
not create: a folder is treated as a phalanx run only if it holds ``.phalanx-run`` (written when
phalanx creates or first adopts an empty folder). A non-empty folder without it is refused with
a message, and nothing in it is touched.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from phalanx.core.errors import ConfigError

MARKER = ".phalanx-run"
# what a run writes at its top level, and the folders it owns
RUN_FILES = ("events.jsonl", "metrics.jsonl", "reference.jsonl", "metrics.superseded.jsonl", "summary.json",
             "coordinator_floor", "report.html", "trace.json", "network.json", "token", "compare_modes.json",
             "compare_modes.md", "commits.jsonl")
RUN_FOLDERS = ("workers", "checkpoints", "plots")


def is_phalanx_run(run_dir: Path) -> bool:
    try:
        doc = json.loads((run_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("phalanx_run") is True


def claim_run_dir(run_dir: Path) -> None:
    """Make ``run_dir`` a phalanx run folder: create it, or adopt it if it is empty or already one.
    Refuses (ConfigError) a non-empty folder that phalanx did not create."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"{run_dir} exists and is not a folder; choose another --out")
    if run_dir.is_dir() and not is_phalanx_run(run_dir) and any(run_dir.iterdir()):
        raise ConfigError(f"{run_dir} is not empty and phalanx did not create it (no {MARKER} file): refusing to "
                          "write a run there, since a fresh run clears the folder's outputs. Choose a new or empty "
                          "--out folder")
    run_dir.mkdir(parents=True, exist_ok=True)
    if not is_phalanx_run(run_dir):
        marker = run_dir / MARKER
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump({"phalanx_run": True, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "owns": [*RUN_FILES, *RUN_FOLDERS, "final_*.safetensors"]}, f)


def clear_run_outputs(run_dir: Path) -> None:
    """A fresh run in a folder that held an earlier one: remove what phalanx wrote there, and only
    in a folder the marker proves is a phalanx run (``claim_run_dir`` first)."""
    if not run_dir.exists():
        return
    if not is_phalanx_run(run_dir):
        raise ConfigError(f"{run_dir} has no {MARKER} file: phalanx removes nothing from a folder it did not create")
    for name in RUN_FILES:
        p = run_dir / name
        if p.is_symlink() or p.is_file():
            p.unlink()
    for p in run_dir.glob("final_*.safetensors"):
        if p.is_symlink() or p.is_file():
            p.unlink()
    for sub in RUN_FOLDERS:
        p = run_dir / sub
        if p.is_symlink():
            p.unlink()  # a link is removed, never followed
        elif p.is_dir():
            shutil.rmtree(p)
