"""Live progress of a run (rich): step, quorum members, loss, recent events."""

from __future__ import annotations

from collections import deque
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

INTERESTING = {"worker_suspected", "step_aborted", "quorum_formed", "worker_healed", "fault_injected",
               "worker_restarted", "worker_exited", "checkpoint_written", "connection_refused", "quorum_stalled",
               "worker_alive_again"}


class Progress:
    """Every line this prints goes through one rich console, so a live progress render and an event
    line never share a line; once the run is over (``stop``) events go to events.jsonl only, so
    they cannot run into what the command prints next."""

    def __init__(self, workers: int, total_steps: int | None, enabled: bool = True,
                 console: Console | None = None) -> None:
        self.total, self.workers = total_steps, workers
        self.enabled = enabled
        self.console = console or Console(stderr=True)
        self._stopped = False
        self._live: Live | None = None
        self._events: deque[str] = deque(maxlen=8)
        self._step, self._qid, self._members, self._loss = -1, 0, [], float("nan")

    def start(self) -> None:
        if self.enabled:
            self._live = Live(self._render(), console=self.console, refresh_per_second=4,
                              transient=False, redirect_stdout=False)
            self._live.start()

    def stop(self) -> None:
        self._stopped = True
        if self._live is not None:
            self._live.update(self._render())
            self._live.stop()
            self._live = None
            if not self.console.is_terminal:
                self.console.line()  # rich leaves a piped final render without its newline

    def on_event(self, ev: dict[str, Any]) -> None:
        name = ev.get("event", "")
        if name == "step_committed":
            self._step, self._qid, self._members, self._loss = ev["step"], ev["quorum_id"], ev["members"], ev["loss"]
        if name in INTERESTING:
            detail = ", ".join(f"{k}={v}" for k, v in ev.items() if k not in ("t", "mono", "node", "event"))
            self._events.append(f"{ev['t']:7.2f}s  {name}  {detail}"[:140])
            if self._live is None and self.enabled and not self._stopped:
                self.console.print(self._events[-1], markup=False, highlight=False, soft_wrap=True)

    def update(self, coord: Any) -> None:
        if self._live is not None:
            self._live.update(self._render())

    def _render(self) -> Group:
        t = Table.grid(padding=(0, 2))
        done = self._step + 1
        bar = ""
        if self.total:
            width = 30
            filled = int(width * min(1.0, done / self.total))
            bar = "[" + "#" * filled + "-" * (width - filled) + f"] {done}/{self.total}"
        else:
            bar = f"{done} steps committed"
        t.add_row(Text("step", style="bold"), bar)
        t.add_row(Text("quorum", style="bold"), f"id {self._qid}: {', '.join(self._members) or '-'}")
        t.add_row(Text("loss", style="bold"), f"{self._loss:.4f}")
        lines = [Text(e, style="dim") for e in self._events]
        return Group(t, *lines)
