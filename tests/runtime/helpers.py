"""Shared by the runtime tests: run a function on a fresh thread (per-thread scheduling settings)."""

from __future__ import annotations

import threading
from typing import Any


def in_thread(fn: Any, timeout_s: float = 60.0) -> Any:
    """``fn()`` on a thread of its own; its value, or its exception raised here."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except Exception as e:  # handed back to the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout_s)
    if "error" in out:
        raise out["error"]
    return out["value"]
