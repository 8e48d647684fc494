"""Progress and event lines share one console and never share a line; nothing is printed after
the run's progress has stopped (the command's own summary comes next)."""

import io

from rich.console import Console

from phalanx.runtime.progress import Progress


def _ev(name, **kw):
    return {"t": 1.0, "node": "launcher", "event": name, **kw}


def test_events_print_as_whole_lines_and_stop_with_the_progress():
    out = io.StringIO()
    p = Progress(2, 10, enabled=True, console=Console(file=out, force_terminal=False, width=200))
    p.on_event(_ev("worker_exited", worker="w0", exit_code=0))  # before the live view: a line of its own
    p.start()
    p.on_event(_ev("step_committed", step=0, quorum_id=1, members=["w0"], loss=1.0))
    p.stop()
    p.on_event(_ev("worker_exited", worker="w1", exit_code=0))  # after: in events.jsonl only
    text = out.getvalue()
    assert text.endswith("\n")
    assert "worker=w1" not in text
    lines = text.splitlines()
    assert any(line.strip().startswith("1.00s  worker_exited  worker=w0") for line in lines)
    assert not any("worker_exited" in line and "step" in line for line in lines)
