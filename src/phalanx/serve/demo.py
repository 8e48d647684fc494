"""The serving step of ``make demo``: ``phalanx serve --demo RUN_DIR``.

4 replicas of the trained model (the latest checkpoint; untrained weights if there is none), one
router per policy in front of the *same* replicas, and one Poisson stream of streamed completions
per router, all at once, through one serving fault plan (replica 3 slowed 10x from the start,
replica 1 SIGKILLed, replica 2 frozen for 3 s): every policy meets the same faults at the same
moments. Prints a latency table per policy and writes ``RUN_DIR/serve-demo/{results.json,report.html}``.
"""

from __future__ import annotations

import asyncio
import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from phalanx.core.auth import read_token_file
from phalanx.serve.cluster import make_token_file, spawn_replicas, spawn_router, stop_replicas
from phalanx.serve.fault_driver import run_fault_plan
from phalanx.serve.loadtest import LoadResult, LoadSpec, run_load, summarize
from phalanx.serve.serving_faults import ServingFault

POLICIES = [("p2c-latency+hedge", "p2c-latency", True), ("p2c-latency", "p2c-latency", False),
            ("p2c-queue", "p2c-queue", False), ("round-robin", "round-robin", False)]


def demo_faults(duration_s: float) -> list[ServingFault]:
    return [ServingFault("straggler", 3, 0.0, None, 10.0, 0),
            ServingFault("kill", 1, round(0.3 * duration_s, 1), None, 1.0, 0),
            ServingFault("freeze", 2, round(0.55 * duration_s, 1), 3.0, 1.0, 0)]


def _model_args(checkpoint: str | None) -> tuple[list[str], str]:
    from phalanx.serve.errors import NoCheckpoint
    from phalanx.serve.served_model import find_checkpoint

    try:
        ckpt = find_checkpoint(checkpoint)
    except NoCheckpoint:
        return ["--random-weights", "0"], "untrained weights (no training run found)"
    return ["--checkpoint", str(ckpt)], str(ckpt)


async def _run(urls: dict[str, str], faults: list[ServingFault], replicas: list[Any], token: bytes,
               duration_s: float, rate_per_s: float) -> tuple[dict[str, LoadResult], list[dict[str, Any]]]:
    driver = asyncio.create_task(run_fault_plan(faults, replicas, token, log=lambda m: print(f"  fault: {m}", flush=True)))
    loads = {name: asyncio.create_task(run_load(LoadSpec(url=url, duration_s=duration_s, rate_per_s=rate_per_s,
                                                         stream=True, max_tokens=16, seed=i, timeout_s=60)))
             for i, (name, url) in enumerate(urls.items())}
    results = {name: await t for name, t in loads.items()}
    return results, await driver


def run_demo(run_dir: Path, checkpoint: str | None = None, duration_s: float = 20.0, rate_per_s: float = 3.0) -> int:
    out = run_dir / "serve-demo"
    out.mkdir(parents=True, exist_ok=True)
    model_args, what = _model_args(checkpoint)
    print(f"phalanx serve --demo: 4 replicas of {what}; one router per policy; {duration_s:g} s of streamed load",
          flush=True)
    token_file = make_token_file(out)
    faults = demo_faults(duration_s)
    reps = spawn_replicas(4, model_args + ["--batch-size-max", "16"], token_file)
    routers = {}
    try:
        for name, policy, hedging in POLICIES:
            routers[name] = spawn_router({r.replica_id: r.url for r in reps}, token_file, policy, hedging)
        results, applied = asyncio.run(_run({n: r.url for n, r in routers.items()}, faults, reps,
                                            read_token_file(token_file), duration_s, rate_per_s))
    finally:
        for r in routers.values():
            r.stop()
        stop_replicas(reps)
    summary = {name: summarize(LoadSpec(url="", rate_per_s=rate_per_s, stream=True), res) for name, res in results.items()}
    rows = _table(summary)
    print("\n".join(rows), flush=True)
    (out / "results.json").write_text(json.dumps({"faults": applied, "policies": summary}, indent=2))
    (out / "report.html").write_text(_html(summary, results, applied, what))
    print(f"report: {out / 'report.html'}", flush=True)
    return 0 if all(s["errors"] == 0 for s in summary.values()) else 1


def fmt(v: float | None) -> str:
    return f"{v:.3f}" if v is not None else "-"


def _table(summary: dict[str, dict[str, Any]]) -> list[str]:
    rows = [f"{'policy':20s} {'ok':>5s} {'failed':>6s} {'p50 s':>7s} {'p99 s':>7s} {'p99.9 s':>8s} {'TTFT p99':>9s}"]
    for name, s in summary.items():
        lat, ttft = s["latency_s"], s["ttft_s"]
        rows.append(f"{name:20s} {s['ok']:5d} {s['errors']:6d} {fmt(lat['p50']):>7s} {fmt(lat['p99']):>7s} "
                    f"{fmt(lat['p99.9']):>8s} {fmt(ttft['p99']):>9s}")
    return rows


def _latency_png(results: dict[str, LoadResult], applied: list[dict[str, Any]]) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for name, res in results.items():
        ax.plot(res.starts_s, res.latencies_s, ".", markersize=4, label=name, alpha=0.7)
    for f in applied:
        ax.axvline(f["t_s"], color="#e45756", alpha=0.5)
        ax.text(f["t_s"], ax.get_ylim()[1] * 0.95, f" {f['kind']} r{f['replica']}", color="#e45756", fontsize=8)
    ax.set_xlabel("request sent at (s)")
    ax.set_ylabel("latency (s)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    return buf.getvalue()


def _html(summary: dict[str, dict[str, Any]], results: dict[str, LoadResult], applied: list[dict[str, Any]],
          what: str) -> str:
    head = "<tr><th>policy</th><th>ok</th><th>failed</th><th>p50 s</th><th>p99 s</th><th>p99.9 s</th><th>TTFT p99 s</th></tr>"
    table = head + "".join(
        f"<tr><td>{html.escape(n)}</td><td>{s['ok']}</td><td>{s['errors']}</td><td>{fmt(s['latency_s']['p50'])}</td>"
        f"<td>{fmt(s['latency_s']['p99'])}</td><td>{fmt(s['latency_s']['p99.9'])}</td><td>{fmt(s['ttft_s']['p99'])}</td></tr>"
        for n, s in summary.items())
    faults = "".join(f"<li>{f['t_s']:.1f} s: {html.escape(f['what'])}</li>" for f in applied)
    png = base64.b64encode(_latency_png(results, applied)).decode()
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>phalanx serve demo</title><style>body{{font-family:"
            f"sans-serif;margin:2em}}td,th{{padding:.2em .8em;text-align:right}}td:first-child{{text-align:left}}</style>"
            f"</head><body><h1>phalanx serve: policies through the same faults</h1><p>4 replicas of {html.escape(what)}; "
            f"one router per policy, all in front of the same replicas, one Poisson stream of streamed completions each."
            f"</p><h2>Faults</h2><ul>{faults}</ul><h2>Latency per policy</h2><table>{table}</table>"
            f"<img alt='latency of every request over time' src='data:image/png;base64,{png}'></body></html>")
