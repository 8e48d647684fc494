"""The run report: one self-contained HTML page and one Perfetto trace per run folder, and a two-run comparison.

The page must open offline, years later, attached to a bug report: plots are embedded PNG data URIs, the CSS is
inline and nothing is fetched. Run folders are read defensively because they are written by processes that may have
been SIGKILLed mid-line, by older versions, and by the simulator, which writes fewer fields.
"""

from __future__ import annotations

import base64
import html
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx.core.errors import ConfigError
from phalanx.obs import plots
from phalanx.obs.trace import build_trace

Record = dict[str, Any]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1000px;
color:#222;padding:0 1em}
h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.15em;margin-top:1.8em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.6em 0;font-size:.92em}
td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
.ok{color:#fff;background:#2e7d32;padding:.1em .5em;border-radius:3px}
.bad{color:#fff;background:#c62828;padding:.1em .5em;border-radius:3px}
img{max-width:100%;height:auto;display:block;margin:.5em 0}.note{color:#666;font-size:.9em}
"""


def read_jsonl(path: Path) -> list[Record]:
    """Every line of ``path`` that parses as a JSON object; a line cut short by a SIGKILL is skipped, not fatal."""
    if not path.is_file():
        return []
    out: list[Record] = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _read_summary(run_dir: Path) -> Record:
    """summary.json (``phalanx train``, simulator) or launch.json (``phalanx launch``); {} if neither is readable."""
    for name in ("summary.json", "launch.json"):
        try:
            data = json.loads((run_dir / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            return data
    return {}


@dataclass
class RunData:
    """Everything a report needs from one run folder, already parsed."""

    run_dir: Path
    summary: Record
    metrics: list[Record]
    events: list[Record]
    workers: dict[str, list[Record]] = field(default_factory=dict)
    reference: list[Record] = field(default_factory=list)


def load_run(run_dir: Path) -> RunData:
    """Parse a run folder, refusing early (ConfigError) when it is not one, so the CLI can say what is missing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run folder; pass the folder `phalanx train --out` wrote")
    for name in ("metrics.jsonl", "events.jsonl"):
        if not (run_dir / name).is_file():
            raise ConfigError(f"{run_dir / name}: missing, so {run_dir} is not a complete run folder; "
                              "re-run `phalanx train --out DIR` (or the simulator) to produce one")
    workers_dir = run_dir / "workers"
    worker_files = sorted(workers_dir.glob("*.jsonl")) if workers_dir.is_dir() else []
    return RunData(run_dir=run_dir, summary=_read_summary(run_dir), metrics=read_jsonl(run_dir / "metrics.jsonl"),
                   events=read_jsonl(run_dir / "events.jsonl"),
                   workers={p.stem: read_jsonl(p) for p in worker_files},
                   reference=read_jsonl(run_dir / "reference.jsonl"))


def _worker_name(value: Any) -> str:
    """Summaries name workers by index (1), events by node name ("w1")."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"w{value}"
    text = str(value) if value is not None else "?"
    return f"w{text}" if text.isdigit() else text


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass
class FaultRow:
    """One injected fault with its timings, all relative to the injection (``t_s`` is coordinator seconds)."""

    kind: str
    worker: str
    at_step: Any
    description: str
    t_s: float | None
    detected_after_s: float | None = None
    recovered_after_s: float | None = None
    ended_after_s: float | None = None
    steps_aborted: int = 0


def _after(events: list[Record], name: str, t_s: float, worker: str | None = None) -> float | None:
    for e in events:
        t = _num(e.get("t"))
        if e.get("event") == name and t is not None and t >= t_s and (worker is None or e.get("worker") == worker):
            return t
    return None


def _time_from_step(run: RunData, at_step: Any) -> float | None:
    """A fault without a fault_injected event fired when ``at_step`` steps had committed."""
    for m in run.metrics:
        if isinstance(at_step, int) and m.get("step") == at_step - 1:
            return _num(m.get("committed_at_s"))
    return None


def fault_rows(run: RunData) -> list[FaultRow]:
    """fault_injected events joined with the summary's fault records (matched by worker and step).

    Detection is the first worker_suspected of that worker after the injection and recovery the first commit after
    detection; the summary's own measurements fill in what the event log cannot say (e.g. when a freeze was lifted).
    """
    pending = [dict(f) for f in run.summary.get("faults") or [] if isinstance(f, dict)]
    rows: list[FaultRow] = []
    for e in (e for e in run.events if e.get("event") == "fault_injected"):
        worker = _worker_name(e.get("worker"))
        match = next((f for f in pending if _worker_name(f.get("worker")) == worker
                      and f.get("at_step") == e.get("at_step")), None)
        if match is not None:
            pending.remove(match)
        rows.append(_row(e, match or {}, _num(e.get("t")), run.events))
    rows += [_row(f, f, _time_from_step(run, f.get("at_step")), run.events) for f in pending]
    return rows


def _row(src: Record, summary_fault: Record, t_s: float | None, events: list[Record]) -> FaultRow:
    worker = _worker_name(src.get("worker"))
    row = FaultRow(kind=str(src.get("kind", "?")), worker=worker, at_step=src.get("at_step"),
                   description=str(src.get("description") or src.get("kind") or "fault"), t_s=t_s,
                   detected_after_s=_num(summary_fault.get("detected_after_s")),
                   recovered_after_s=_num(summary_fault.get("recovered_after_s")),
                   ended_after_s=_num(summary_fault.get("ended_after_s")))
    if t_s is None:
        return row
    detected = _after(events, "worker_suspected", t_s, worker)
    if detected is not None:
        row.detected_after_s = detected - t_s
    if row.detected_after_s is not None:
        recovered = _after(events, "step_committed", t_s + row.detected_after_s)
        if recovered is not None:
            row.recovered_after_s = recovered - t_s
    end_s = t_s + max(row.recovered_after_s or 0.0, row.ended_after_s or 0.0)
    row.steps_aborted = sum(1 for e in events if e.get("event") == "step_aborted"
                            and t_s <= (_num(e.get("t")) or -1.0) <= end_s)
    return row


def _fault_marks(rows: list[FaultRow]) -> list[plots.FaultMark]:
    return [plots.FaultMark(label=f"F{i}: {r.kind} {r.worker}", t_s=r.t_s,
                            ended_s=r.t_s + r.ended_after_s if r.ended_after_s is not None else None,
                            detected_s=r.t_s + r.detected_after_s if r.detected_after_s is not None else None)
            for i, r in enumerate(rows, 1) if r.t_s is not None]


# ---------------------------------------------------------------- HTML pieces


def _fmt(value: Any) -> str:
    """A value as escaped table text: floats to 4 significant digits, missing as a dash."""
    if value is None:
        return "&mdash;"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return html.escape(f"{value:.4g}")
    if isinstance(value, (dict, list)):
        return html.escape(json.dumps(value, sort_keys=True, default=str))
    return html.escape(str(value))


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f'<td class="num">{_fmt(c)}</td>' if isinstance(c, (int, float))
                                    and not isinstance(c, bool) else f"<td>{_fmt(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_CSS}</style></head><body>\n{body}\n</body></html>\n")


def steps_committed(run: RunData) -> int:
    value = run.summary.get("steps_committed")
    return value if isinstance(value, int) and not isinstance(value, bool) else len(run.metrics)


def _summary_section(run: RunData) -> str:
    s = run.summary
    ok = s.get("ok")
    badge = ('<span class="ok">OK</span>' if ok is True else '<span class="bad">FAILED</span>' if ok is False
             else '<span class="bad">no summary</span>')
    rows = [["result", s.get("reason")], ["workers", s.get("workers")],
            ["steps committed / planned", f"{steps_committed(run)} / {_fmt(s.get('steps'))}"],
            ["steps retried", s.get("steps_retried")], ["final loss", s.get("final_loss")],
            ["reference final loss", s.get("reference_final_loss")],
            ["max |param - reference|", s.get("reference_max_abs_diff")],
            ["samples seen exactly once", s.get("samples_exactly_once")],
            ["false suspicions", s.get("false_suspicions")], ["wall time (s)", s.get("wall_s")]]
    shown = {"reason", "workers", "steps", "steps_committed", "steps_retried", "final_loss", "reference_final_loss",
             "reference_max_abs_diff", "samples_exactly_once", "false_suspicions", "wall_s", "ok", "faults",
             "control_plane"}
    rows += [[k, v] for k, v in sorted(s.items()) if k not in shown and isinstance(v, (str, int, float, bool))]
    return (f"<h1>phalanx run report {badge}</h1><p class=\"note\">{html.escape(str(run.run_dir))}</p>"
            + _table(["", "value"], [[k, v] for k, v in rows]))


def _faults_section(rows: list[FaultRow]) -> str:
    if not rows:
        return "<h2>Faults</h2><p>No faults were injected.</p>"
    body = [[f"F{i}", r.kind, r.worker, r.at_step, r.description, r.t_s, r.detected_after_s, r.recovered_after_s,
             r.ended_after_s, r.steps_aborted] for i, r in enumerate(rows, 1)]
    return ("<h2>Faults</h2>" + _table(["", "kind", "worker", "at step", "description", "injected at (s)",
                                        "detected after (s)", "recovered after (s)", "lifted after (s)",
                                        "steps aborted"], body)
            + '<p class="note">Detected: first suspicion of that worker. Recovered: first commit after detection. '
              "Times are seconds after the injection.</p>")


def _transport_section(run: RunData) -> str:
    cp = run.summary.get("control_plane")
    if not isinstance(cp, dict) or not cp:
        return "<h2>Control-plane traffic</h2><p>Not recorded for this run.</p>"
    steps = steps_committed(run)
    rows = [[k, v, (v / steps if steps else None)] for k, v in cp.items() if _num(v) is not None]
    rejected = cp.get("rejected")
    rows += [[f"rejected: {k}", v, None] for k, v in sorted(rejected.items())] if isinstance(rejected, dict) else []
    return ("<h2>Control-plane traffic</h2><p>The network is not free: these are the coordinator's measured totals "
            f"over {steps} committed steps.</p>" + _table(["counter", "total", "per committed step"], rows))


def write_report(run_dir: Path, out_html: Path | None = None) -> dict[str, Any]:
    """Write report.html (or ``out_html``) and trace.json for ``run_dir``; returns their paths and plot names."""
    run = load_run(Path(run_dir))
    rows = fault_rows(run)
    breakdowns = {name: plots.time_breakdown(recs) for name, recs in run.workers.items()}
    images = {"loss": plots.loss_png([("run", run.metrics)], run.reference or None),
              "step_time": plots.step_time_png([("step time", run.metrics)], _fault_marks(rows)),
              "worker_time": plots.worker_time_png(breakdowns)}
    time_rows = [[name] + [b.get(c, 0.0) for c in plots.TIME_CATEGORIES] for name, b in sorted(breakdowns.items())]
    body = "".join([
        _summary_section(run),
        "<h2>Loss</h2>", _img(images["loss"], "loss against step"),
        "" if run.reference else '<p class="note">No reference.jsonl in this run: only the run\'s loss is shown.</p>',
        "<h2>Step time</h2>", _img(images["step_time"], "step time against time, faults marked"),
        '<p class="note">Red line: injection; shaded: a timed fault in effect; dotted: detection.</p>',
        _faults_section(rows),
        "<h2>Time per worker</h2>", _img(images["worker_time"], "per-worker time breakdown"),
        _table(["worker"] + [f"{c} (s)" for c in plots.TIME_CATEGORIES], time_rows),
        _transport_section(run),
        '<p class="note">Open trace.json in ui.perfetto.dev for the per-span timeline.</p>'])
    report = Path(out_html) if out_html else run.run_dir / "report.html"
    report.write_text(_page(f"phalanx report {run.run_dir.name}", body), encoding="utf-8")
    trace = run.run_dir / "trace.json"
    trace.write_text(json.dumps(build_trace(run.events, run.workers)), encoding="utf-8")
    return {"report": report, "trace": trace, "plots": list(images)}


# ---------------------------------------------------------------- two-run comparison


def _step_times_s(run: RunData) -> list[float]:
    """Step times without step 0, which includes start-up and initial healing and would swamp the average."""
    return [float(m["step_s"]) for m in run.metrics[1:] if _num(m.get("step_s")) is not None]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def comparison_metrics(run: RunData) -> dict[str, float | int | bool | None]:
    """The numbers two runs are compared on; per-step traffic makes runs of different lengths comparable."""
    s, steps, times = run.summary, steps_committed(run), _step_times_s(run)
    cp = s.get("control_plane") if isinstance(s.get("control_plane"), dict) else {}
    rows = fault_rows(run)

    def per_step(key: str) -> float | None:
        v = _num(cp.get(key))
        return v / steps if v is not None and steps else None

    def mean(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.fmean(present) if present else None

    return {"ok": s.get("ok"), "workers": s.get("workers"), "steps committed": steps,
            "steps retried": s.get("steps_retried"), "final loss": s.get("final_loss"),
            "max |param - reference|": s.get("reference_max_abs_diff"),
            "samples exactly once": s.get("samples_exactly_once"), "wall time (s)": s.get("wall_s"),
            "median step (s)": statistics.median(times) if times else None,
            "p95 step (s)": _percentile(times, 0.95), "faults": len(rows),
            "mean detection (s)": mean([r.detected_after_s for r in rows]),
            "mean recovery (s)": mean([r.recovered_after_s for r in rows]),
            "false suspicions": s.get("false_suspicions"),
            "bytes sent per step": per_step("bytes_sent"), "frames sent per step": per_step("frames_sent"),
            "bytes received per step": per_step("bytes_received"),
            "frames received per step": per_step("frames_received")}


def _ratio(a: Any, b: Any) -> float | None:
    a_num, b_num = _num(a), _num(b)
    return b_num / a_num if a_num and b_num is not None else None


def compare_runs(run_a: Path, run_b: Path, out: Path | None = None) -> Path:
    """Write an HTML page comparing run A with run B (default ``RUN_B/compare.html``); ratios are B / A."""
    a, b = load_run(Path(run_a)), load_run(Path(run_b))
    label_a, label_b = f"A: {a.run_dir.name}", f"B: {b.run_dir.name}"
    if a.run_dir.name == b.run_dir.name:
        label_a, label_b = f"A: {a.run_dir}", f"B: {b.run_dir}"
    ma, mb = comparison_metrics(a), comparison_metrics(b)
    rows = [[k, ma[k], mb[k], _ratio(ma[k], mb[k])] for k in ma]
    loss = plots.loss_png([(label_a, a.metrics), (label_b, b.metrics)], a.reference or b.reference or None)
    step = plots.step_time_png([(label_a, a.metrics), (label_b, b.metrics)])
    body = "".join([
        "<h1>phalanx run comparison</h1>",
        f'<p class="note">{html.escape(label_a)}<br>{html.escape(label_b)}</p>',
        "<h2>Summary</h2>", _table(["metric", "A", "B", "B / A"], rows),
        "<h2>Loss</h2>", _img(loss, "loss of both runs"),
        "<h2>Step time</h2>", _img(step, "step time of both runs"),
        '<p class="note">Each run\'s time axis starts at its own coordinator start.</p>'])
    target = Path(out) if out else b.run_dir / "compare.html"
    target.write_text(_page("phalanx run comparison", body), encoding="utf-8")
    return target
