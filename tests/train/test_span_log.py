"""The worker's span log keeps a line a reentrant write refused (a gil_hang fault's handler
interrupting the training thread inside a write to the same file) and writes it before the next."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

from phalanx.train.torch_state import SpanLog


class _RefusesOnce:
    """The file as a signal handler finds it in the middle of a write: the first call is refused."""

    def __init__(self, inner) -> None:
        self.inner, self.refused = inner, False

    def write(self, text: str) -> int:
        if not self.refused:
            self.refused = True
            raise RuntimeError("reentrant call inside <_io.BufferedWriter>")
        return self.inner.write(text)

    def close(self) -> None:
        self.inner.close()


def _events(path: Path) -> list[str]:
    return [json.loads(line).get("event") or json.loads(line).get("span") for line in path.read_text().splitlines()]


def test_a_refused_line_waits_and_goes_out_first_with_its_own_time(tmp_path: Path) -> None:
    path = tmp_path / "w0.jsonl"
    log = SpanLog(path, "w0")
    log._f = _RefusesOnce(log._f)
    log.event("fault_begin", kind="gil_hang")  # refused: kept
    log.span("allreduce", 1.0, step=3)
    log.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x.get("event") or x.get("span") for x in lines] == ["fault_begin", "allreduce"]
    assert lines[0]["mono"] > lines[1]["mono"]  # stamped when it happened, not when written


def test_an_event_from_a_signal_handler_during_writes_is_never_lost_nor_raises(tmp_path: Path) -> None:
    """The real case: SIGUSR1 handlers writing while the main thread writes the same log."""
    path = tmp_path / "w0.jsonl"
    log = SpanLog(path, "w0")
    fired = []

    def handler(signum, frame) -> None:
        log.event("from_handler")
        fired.append(1)

    old = signal.signal(signal.SIGUSR1, handler)
    stop = threading.Event()

    def poke() -> None:
        while not stop.is_set():
            os.kill(os.getpid(), signal.SIGUSR1)
            stop.wait(0.0005)

    t = threading.Thread(target=poke)
    t.start()
    try:
        for i in range(20000):
            log.span("body", 0.0, i=i, pad="x" * 200)
            if len(fired) >= 200:
                break
    finally:
        stop.set()
        t.join()
        signal.signal(signal.SIGUSR1, old)
    log.event("last")
    log.close()
    names = _events(path)
    assert names.count("from_handler") == len(fired) and names[-1] == "last"


def test_the_control_threads_lines_wait_at_most_flush_s_and_none_is_lost_at_close(tmp_path: Path) -> None:
    """Spans and the bound loop's thread's events wait in memory (one write for many); other
    threads' events go out at once; the timer, a full batch and close() write what waits."""
    import asyncio
    import time

    from phalanx.train import torch_state

    path = tmp_path / "w0.jsonl"
    log = SpanLog(path, "w0")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        log.batch_on(loop)
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(5)  # bound by now
        asyncio.run_coroutine_threadsafe(_on_loop(lambda: log.event("committed", step=1)), loop).result(5)
        log.span("allreduce", time.monotonic(), step=1)  # the user's thread's span joins the batch
        log.event("speculation_undone", step=1)  # ... its events go out at once
        assert _events(path) == ["speculation_undone"]
        time.sleep(torch_state.FLUSH_S + 0.2)  # the loop's timer wrote the batch
        assert _events(path) == ["speculation_undone", "committed", "allreduce"]
        for i in range(torch_state.BATCH_MAX):  # a full batch goes out without waiting for the timer
            asyncio.run_coroutine_threadsafe(_on_loop(lambda i=i: log.event("committed", step=i)), loop).result(5)
        assert len(_events(path)) == 3 + torch_state.BATCH_MAX
        asyncio.run_coroutine_threadsafe(_on_loop(lambda: log.span("quorum_wait", 0.0, step=9)), loop).result(5)
        log.close()  # what still waits is written
        assert _events(path)[-1] == "quorum_wait"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


async def _on_loop(fn) -> None:
    fn()
