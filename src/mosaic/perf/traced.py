"""Stage by stage: what the model predicts against what a traced step of the engine measured.

`mosaic bench` records, per plan, each module's forward and backward start and end on its
stream (`traced_step` in the results, or `<plan>.trace.json` beside a results file written
before that). The whole-iteration gate says how far a plan's step is off; this says where:

- a stage holding one module on the whole GPU is that module alone, as the engine runs it,
  against its profiled surface (a surface measured in other conditions than the engine's,
  or stale, shows here first);
- a colocated stage is the colocation as the engine runs it (forward side by side, later
  stages, backward side by side) against the interference model's prediction;
- where the same run traced a plan that runs those modules one by one (megatron), the
  saving the colocation was predicted to make is set against the saving measured.

Without traces, `colocation_savings` sets each one-GPU colocating plan's whole-step saving over
its placements run one by one against what it measured faster than the run's megatron plan.

A stage's measured time is, on its slowest GPU, the forward span of its modules (first start
to last end) plus their backward span; the prediction is the model's stage compute time
(`PerfModel.stage_compute_s`). Both leave out the gradient all-reduce, the activation
transfers and the optimizer.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from mosaic.files import portable_stem
from mosaic.perf.engine_term import sequential_plan
from mosaic.perf.profiled import SURFACE_DRIFT, remeasure_command
from mosaic.perf.results import bench_result_files, load_current_result

__all__ = ["colocation_savings", "measured_stage_s", "overlapping_stages", "sharing_text",
           "stage_error", "traced_events"]

SEQUENTIAL_PLANNER = "megatron"
"""The baseline whose plan runs every module alone on the whole GPU(s), stage after stage."""
PHASES = ("fwd", "bwd")
OVERLAP_MIN_S = 1e-4
"""Stages whose spans cross by less are taken as one after the other: a traced event is the
median of several steps' starts and ends taken apart, so adjacent ones can cross by a few
microseconds (CLIP's head 3 us into its encoders' forward, 2026-12-02)."""


def traced_events(path: Path, row: dict[str, Any]) -> list[dict[str, Any]]:
    """The row's traced step: from the results (`traced_step`), else from the Chrome trace
    `mosaic bench --out` wrote beside them (`<results stem>/<planner>.trace.json`, the
    planner's label as a portable file name)."""
    if row.get("traced_step"):
        return list(row["traced_step"])
    trace = path.with_suffix("") / f"{portable_stem(str(row.get('planner')))}.trace.json"
    if not trace.is_file():
        return []
    try:
        events = json.loads(trace.read_text())["traceEvents"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        return []
    return [{"module": e["name"], "phase": e["cat"], "gpu": e["pid"],
             "stage": e["args"]["stage"], "start_s": e["ts"] * 1e-6,
             "end_s": (e["ts"] + e["dur"]) * 1e-6}
            for e in events if e.get("cat") in PHASES and "stage" in e.get("args", {})]


def measured_stage_s(events: Iterable[dict[str, Any]], stage: int) -> float | None:
    """Forward span plus backward span of the stage's modules on its slowest GPU; None when
    the trace lacks either phase of the stage."""
    spans: dict[int, dict[str, tuple[float, float]]] = {}
    for e in events:
        if e["stage"] != stage or e["phase"] not in PHASES:
            continue
        start, end = spans.setdefault(e["gpu"], {}).get(e["phase"], (e["start_s"], e["end_s"]))
        spans[e["gpu"]][e["phase"]] = (min(start, e["start_s"]), max(end, e["end_s"]))
    per_gpu = [sum(end - start for start, end in phases.values())
               for phases in spans.values() if set(phases) == set(PHASES)]
    return max(per_gpu) if per_gpu else None


def overlapping_stages(events: Iterable[dict[str, Any]], stage: int) -> list[int]:
    """Other stages whose modules ran (same phase, same GPU) while this stage's did. The engine
    orders stages only by data: a later stage on another stream whose inputs are ready starts
    under an earlier one (ImageBind b128's audio stage under its text+vision stage, traced
    2026-12-02), and its span then measures neither it alone nor the stage as planned."""
    events = list(events)
    mine = [e for e in events if e["stage"] == stage and e["phase"] in PHASES]
    return sorted({e["stage"] for e in events if e["stage"] != stage and any(
        e["phase"] == m["phase"] and e["gpu"] == m["gpu"]
        and min(e["end_s"], m["end_s"]) - max(e["start_s"], m["start_s"]) > OVERLAP_MIN_S
        for m in mine)})


def _stage_rows(name: str, path: Path, report: dict[str, Any], row: dict[str, Any],
                repredict: Any) -> list[dict[str, Any]]:
    events = traced_events(path, row)
    resolved = repredict.resolve(report, row) if events else None
    if resolved is None:
        return []
    model, plan, graph = resolved
    rows = []
    for index, (stage, one_by_one) in enumerate(zip(plan.stages, sequential_plan(plan).stages,
                                                    strict=True)):
        measured = measured_stage_s(events, index)
        if measured is None:
            continue
        predicted = model.stage_compute_s(stage, graph)
        alone = {p.module: model.stage_compute_s(replace(one_by_one, placements=(p,)), graph)
                 for p in one_by_one.placements}
        rows.append({"file": name, "model": report.get("model"), "preset": report.get("preset"),
                     "kernels": model.surfaces.prefer,
                     "gpus": report.get("gpus"), "global_batch": report.get("global_batch"),
                     "planner": row["planner"], "stage": index,
                     "modules": [p.module for p in stage.placements], "sharing": stage.sharing,
                     "sm_shares": [round(p.sm_share, 3) for p in stage.placements],
                     "predicted_s": predicted, "measured_s": measured,
                     "error": predicted / measured - 1, "predicted_alone_s": alone,
                     "overlaps": overlapping_stages(events, index)})
    return rows


def _savings(rows: list[dict[str, Any]]) -> None:
    """Per colocated stage, the saving over the same run's one-by-one plan, both predicted and
    measured, where that plan traced each of the stage's modules alone in one-module stages."""
    alone: dict[tuple[str, str], dict[str, float]] = {}
    for r in rows:
        if r["planner"] == SEQUENTIAL_PLANNER and len(r["modules"]) == 1:
            alone.setdefault((r["file"], r["modules"][0]), r)
    for r in rows:
        if len(r["modules"]) < 2:
            continue
        solo = [alone.get((r["file"], m)) for m in r["modules"]]
        if any(s is None for s in solo):
            continue
        r["predicted_saving_s"] = sum(r["predicted_alone_s"].values()) - r["predicted_s"]
        r["measured_saving_s"] = sum(s["measured_s"] for s in solo) - r["measured_s"]


def stage_error(paths: str | Path | Iterable[str | Path], repredict: Any) -> dict[str, Any]:
    """Every traced plan's stages under `paths` (superseded runs left out), today's model
    (`repredict`, a perf.repredict.Repredictor) against the traces."""
    rows: list[dict[str, Any]] = []
    for name, path in bench_result_files(paths):
        report = load_current_result(path)
        if report is None:
            continue
        for row in report.get("results", []):
            rows += _stage_rows(name, path, report, row, repredict)
    _savings(rows)
    savings = [r for r in rows if "measured_saving_s" in r and not r.get("overlaps")]
    predicted_saving = sum(r["predicted_saving_s"] for r in savings)
    judged = [r for r in rows if not r.get("overlaps")]  # an overlapped span is no stage time
    return {
        "rows": rows,
        "overlapped": len(rows) - len(judged),
        "alone_error": _summed_error([r for r in judged if len(r["modules"]) == 1]),
        "colocated_error": _summed_error([r for r in judged if len(r["modules"]) > 1]),
        "median_abs_error": (statistics.median(abs(r["error"]) for r in judged) if judged
                             else None),
        "saving_realized": (sum(r["measured_saving_s"] for r in savings) / predicted_saving
                            if savings and predicted_saving > 0 else None),
        "suspect_surfaces": suspect_surfaces(rows),
    }


def _summed_error(rows: list[dict[str, Any]]) -> float | None:
    """Predicted over measured time, summed over the stages, minus one: weighted by time, so a
    0.1 ms head 30% off does not outweigh a 10 ms encoder 5% off."""
    measured = sum(r["measured_s"] for r in rows)
    return sum(r["predicted_s"] for r in rows) / measured - 1 if measured > 0 else None


STALE_MIN_S = 1e-3
"""One-module stages shorter than this are not judged for staleness: a head of 0.1 ms is mostly
launch and stream hand-off, which no surface of the module holds."""


def suspect_surfaces(rows: Iterable[dict[str, Any]],
                     tolerance: float = SURFACE_DRIFT) -> list[str]:
    """A module the engine ran alone (a one-module stage) further from its surface than the
    drift check allows: the same finding as a colocation's alone times give
    (SurfaceSet.drift), from any traced bench run; one line each, with the command."""
    found = {}
    for r in rows:
        if (len(r["modules"]) == 1 and not r.get("overlaps") and r["measured_s"] >= STALE_MIN_S
                and abs(r["error"]) > tolerance):
            key = (r["model"], r["preset"], r["modules"][0], r["kernels"])
            found.setdefault(key, r)
    return [f"{model} {module} (`{preset}`, {r['file']}, {r['planner']}): the engine ran it "
            f"alone in {r['measured_s'] * 1e3:.2f} ms, its {kernels} surface says "
            f"{r['predicted_s'] * 1e3:.2f}; stale? measure it again: "
            f"{remeasure_command(model, preset, kernels)}"
            for (model, preset, module, kernels), r in found.items()]


def _same_engine(planner: str, label: str) -> str:
    """`planner`'s row under the engine variant of the row labelled `label`
    (`mosaic@bf16_weights=true` -> `megatron@bf16_weights=true`): a variant's saving is
    measured against the one-by-one plan of the same engine, not of the base engine."""
    _, at, variant = label.partition("@")
    return planner + at + variant


def colocation_savings(paths: str | Path | Iterable[str | Path], repredict: Any
                       ) -> list[dict[str, Any]]:
    """Whole steps, no trace needed: every one-GPU plan that colocates, its composed saving
    over its own placements run one by one (today's model, no engine term), against what it
    measured faster than the same run's one-by-one plan (megatron). The engine term's
    `colocation_saving` feature takes back the average shortfall; this shows where it is."""
    rows = []
    for name, path in bench_result_files(paths):
        report = load_current_result(path)
        if report is None:
            continue
        measured = {r["planner"]: r["measured_iteration_s"] for r in report.get("results", [])
                    if r.get("measured_iteration_s")}
        if report.get("gpus") != 1:
            continue
        for row in report["results"]:
            one_by_one = measured.get(_same_engine(SEQUENTIAL_PLANNER, row["planner"]))
            plan = repredict.predict(report, row, engine_term=False)
            alone = repredict.predict(report, row, engine_term=False, sequential=True)
            if one_by_one is None or plan is None or alone is None or alone - plan <= 1e-4:
                continue
            saving = one_by_one - row["measured_iteration_s"]
            rows.append({"file": name, "model": report.get("model"),
                         "preset": report.get("preset"), "global_batch": report.get("global_batch"),
                         "planner": row["planner"], "predicted_saving_s": alone - plan,
                         "measured_saving_s": saving, "realized": saving / (alone - plan)})
    return rows


def print_stage_error(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="stages of traced plans: today's model vs the engine's traced step")
    for column in ("file", "planner", "stage", "modules", "sharing", "predicted, ms",
                   "measured, ms", "error", "saving predicted / measured, ms"):
        table.add_column(column)
    for r in report["rows"]:
        saving = (f"{r['predicted_saving_s'] * 1e3:.2f} / {r['measured_saving_s'] * 1e3:.2f}"
                  if "measured_saving_s" in r else "–")
        table.add_row(r["file"], r["planner"], str(r["stage"]), "+".join(r["modules"]),
                      sharing_text(r), f"{r['predicted_s'] * 1e3:.2f}",
                      f"{r['measured_s'] * 1e3:.2f}", f"{r['error']:+.1%}", saving)
    console = Console()
    console.print(table)
    console.print(summary_line(report))
    for line in report["suspect_surfaces"]:
        console.print(line)


def sharing_text(row: dict[str, Any]) -> str:
    """The stage's sharing mode, and the stages it ran under, if any."""
    under = row.get("overlaps")
    return row["sharing"] + (f" (under stage {', '.join(map(str, under))})" if under else "")


def summary_line(report: dict[str, Any]) -> str:
    """The time-weighted errors of modules alone and of colocations, and the saving realized."""
    def pct(x: float | None, sign: str = "+") -> str:
        return "–" if x is None else f"{x:{sign}.1%}"

    if not report["rows"]:
        return ("no traced plans: `mosaic bench` records each plan's traced step in its "
                "results (traced_step) from 2026-12-02 on; older results need --out's traces")
    overlapped = report.get("overlapped", 0)
    left_out = (f", {overlapped} that ran under another stage left out" if overlapped else "")
    return (f"{len(report['rows'])} traced stages{left_out} (median |error| "
            f"{pct(report['median_abs_error'], '')}); summed over stages, modules alone "
            f"predicted {pct(report['alone_error'])}, colocations "
            f"{pct(report['colocated_error'])}; of the saving predicted for colocations, "
            f"{pct(report['saving_realized'], '')} measured")
