"""What `mosaic bench` writes and prints: results JSON, measured timelines, a table."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mosaic.files import portable_stem, write_text_atomic
from mosaic.report.timeline import TimelineEvent, plot_timeline, write_chrome_trace


def measured_events(timeline: list[dict]) -> list[TimelineEvent]:
    """Engine timeline records -> events; forward and backward become separate bars."""
    events = []
    for e in timeline:
        events.append(TimelineEvent(module=e["module"], stage=e["stage"], gpu=e["gpu"],
                                    start_s=e["start_s"], end_s=e["end_s"],
                                    sm_share=e.get("sm_share", 1.0), phase=e["phase"]))
    return _lanes(events)


def _lanes(events: list[TimelineEvent]) -> list[TimelineEvent]:
    """Stack bars that overlap in time on one GPU so none hides another (their heights; each
    event keeps its plan's SM share)."""
    placed: list[TimelineEvent] = []
    for e in sorted(events, key=lambda e: (e.gpu, e.start_s)):
        busy = [p for p in placed if p.gpu == e.gpu and p.start_s < e.end_s and e.start_s < p.end_s]
        share = e.sm_share if not busy else min(e.sm_share, 1.0 / (len(busy) + 1))
        lane = min(0.999, sum(p.height for p in busy)) if busy else 0.0
        placed.append(dataclasses.replace(e, lane=lane, bar=max(0.05, min(share, 1.0 - lane))))
    return placed


def write_bench_json(report: dict, out: Path) -> Path:
    """The results first: plotting the timelines takes seconds, and a run stopped by a time
    limit while plotting keeps its numbers."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(out / "bench.json", json.dumps(report, indent=2, default=str))


def write_bench_timelines(report: dict, measurements, out: Path) -> None:
    """One PNG and one Chrome trace per measured plan's step."""
    for m in measurements:
        if m.timeline:
            events = measured_events(m.timeline)
            stem = portable_stem(m.label)
            plot_timeline(events, Path(out) / f"{stem}.png",
                          f"{report['model']} ({report['preset']}), {m.label}: one measured step, "
                          f"{m.median_s * 1e3:.1f} ms median")
            write_chrome_trace(events, Path(out) / f"{stem}.trace.json")


def _in_flight_cell(row: dict) -> str:
    """The step run in flight and its MFU (results before it was measured have neither)."""
    if row.get("in_flight_median_s") is None:
        return "-"
    return f"{row['in_flight_median_s'] * 1e3:.2f} ms ({row['mfu_in_flight'] * 100:.1f}%)"


def print_bench_table(report: dict) -> None:
    table = Table(title=(f"{report['model']} ({report['preset']}, batch {report['global_batch']}) "
                         f"on {report['gpus']} x {report['hardware']}"))
    for column in ("planner", "measured (median)", "p10-p90", "predicted", "error",
                   "vs best baseline", "samples/s", "MFU", "in flight (MFU)", "GPU util",
                   "launch/step", "quotas"):
        table.add_column(column, justify="left" if column == "planner" else "right")
    best = report.get("best_baseline_s")
    for r in report["results"]:
        error = r.get("prediction_error")
        util = r.get("measured_gpu_util")
        table.add_row(
            r["planner"], f"{r['measured_iteration_s'] * 1e3:.2f} ms",
            f"{r['p10_s'] * 1e3:.2f}-{r['p90_s'] * 1e3:.2f}",
            f"{r['predicted_iteration_s'] * 1e3:.2f} ms" if r["predicted_iteration_s"] else "-",
            f"{error * 100:+.1f}%" if error is not None else "-",
            f"{best / r['measured_iteration_s']:.2f}x" if best else "-",
            f"{r['samples_per_s']:.1f}", f"{r['mfu'] * 100:.1f}%", _in_flight_cell(r),
            f"{util * 100:.0f}%" if util is not None else "-",
            f"{r['host_launch_share']:.0%}" if r.get("host_launch_share") is not None else "-",
            "enforced" if r["quotas_enforced"] else r["pool_backend"],
        )
    console = Console(width=184)
    console.print(table)
    console.print(f"{report['date']}  torch {report['torch']}  perf model: "
                  f"{report.get('perf_model', '-')}", markup=False)  # "[alpha=...]" is text
    for label, why in report.get("checks", {}).get("user_programs_left_out", {}).items():
        console.print(f"{label}: not measured: it {why}", markup=False, soft_wrap=True)
