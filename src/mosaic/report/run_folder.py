"""A training run's folder: everything needed to read, compare and reproduce a run.

    runs/NAME/
      config.json      the resolved job (every option, after the config file and overrides)
      env.json         package versions, git SHA, GPU name and SM count (or 'cpu'), command
      plan.json        the plan trained (Plan JSON)
      metrics.jsonl    one line per step (loss, step time, samples/s)
      summary.json     the trainer's summary
      timeline.json    Chrome trace (Perfetto): measured last step beside the prediction
      timeline.png     the same as a Gantt chart
      curves.png       per step: the loss, the step time, and the learning rate and gradient
                       norm where the run scheduled or clipped them

`check_run_dir` refuses an existing non-empty folder (unless overwrite) before any work;
`write_run_folder` is called on rank 0 after training. Every file is written atomically.
"""

from __future__ import annotations

import json
import platform
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from mosaic.files import OutputError, check_out_dir, write_text_atomic
from mosaic.provenance import git_sha, package_versions

MEASURED_GPU_OFFSET = 1000
"""Chrome-trace pid of measured GPU g is g + this, so the two timelines sit side by side."""


def check_run_dir(path: Path, overwrite: bool = False, option: str = "--out") -> Path:
    """`path` can become this run's folder: absent, empty, or `overwrite` given; creates nothing."""
    path = check_out_dir(Path(path), option)
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise OutputError(f"{option} {path}: the folder exists and is not empty; choose a new "
                          f"name or pass --overwrite")
    return path


def environment(device: str = "cpu") -> dict[str, Any]:
    """Versions, git SHA (when run from a checkout), and the GPU (name, SM count) or 'cpu'."""
    env: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                           "packages": package_versions(), "git_sha": git_sha(), "argv": sys.argv,
                           "gpu": "cpu"}
    if device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        env["gpu"] = {"name": props.name, "sm_count": props.multi_processor_count,
                      "memory_bytes": props.total_memory, "cuda": torch.version.cuda,
                      "count": torch.cuda.device_count()}
    return env


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str) + "\n"


def write_run_folder(out: Path, *, config: dict[str, Any], result: Any, graph: Any = None,
                     perf: Any = None) -> list[Path]:
    """Write the run folder from the trainer's TrainResult; returns the files written.

    `graph` and `perf` (a performance model) add the predicted timeline when the plan has a
    prediction; the measured one comes from `result.timeline` (EngineConfig.timeline on)."""
    from mosaic.report.timeline import (
        TimelineEvent,
        chrome_trace,
        plot_timeline,
        predicted_timeline,
    )

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = result.summary
    written = [write_text_atomic(out / "config.json", _json(config)),
               write_text_atomic(out / "env.json", _json(environment(str(summary.get("device",
                                                                                    "cpu"))))),
               write_text_atomic(out / "summary.json", _json(summary)),
               write_text_atomic(out / "metrics.jsonl",
                                 "".join(json.dumps(row) + "\n" for row in result.steps))]
    result.plan.save(out / "plan.json")
    written.append(out / "plan.json")
    predicted: list[TimelineEvent] = []
    if graph is not None and perf is not None and result.plan.predicted_iteration_s is not None:
        predicted = [replace(e, phase="predicted") for e in predicted_timeline(result.plan, graph,
                                                                                perf)]
    measured = [TimelineEvent(module=e["module"], stage=e["stage"], gpu=e["gpu"],
                              start_s=e["start_s"], end_s=e["end_s"], sm_share=e["sm_share"],
                              phase=f"measured {e.get('phase', '')}".strip())
                for e in result.timeline]
    trace = chrome_trace(predicted)
    shifted = [replace(e, gpu=e.gpu + MEASURED_GPU_OFFSET) for e in measured]
    trace["traceEvents"] += chrome_trace(shifted)["traceEvents"]
    trace["traceEvents"] += [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}}
        for pid, label in sorted({**{e.gpu: f"GPU {e.gpu} predicted" for e in predicted},
                                  **{e.gpu: f"GPU {e.gpu - MEASURED_GPU_OFFSET} measured"
                                     for e in shifted}}.items())]
    written.append(write_text_atomic(out / "timeline.json", json.dumps(trace)))
    if result.steps:
        written.append(plot_curves(result.steps, out / "curves.png",
                                   f"{summary.get('model')} plan={result.plan.planner}"))
    events = measured or predicted
    if events:
        title = (f"{summary.get('model')} plan={result.plan.planner}: "
                 f"{'measured last step' if measured else 'predicted'}")
        written.append(plot_timeline(events, out / "timeline.png", title))
    return written


CURVES = (("loss", "loss", 1.0), ("step_time_s", "step time, ms", 1e3), ("lr", "learning rate", 1.0),
          ("grad_norm", "gradient norm (before clipping)", 1.0))
"""(metrics key, panel title, scale): a panel per key some step holds."""


def plot_curves(steps: list[dict[str, Any]], path: Path, title: str) -> Path:
    """A panel per metric of `steps` (CURVES) against the step; the steps the timing summary
    leaves out (its warm-up, not the learning rate's) hollow."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from mosaic.files import atomic_path

    panels = [(key, label, scale) for key, label, scale in CURVES
              if any(row.get(key) is not None for row in steps)]
    fig = Figure(figsize=(4 * len(panels), 3.2))
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.07, right=0.98, top=0.82, bottom=0.17, wspace=0.3)
    for ax, (key, label, scale) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels,
                                       strict=True):
        rows = [r for r in steps if r.get(key) is not None]
        for warm, marker in ((True, "o"), (False, ".")):
            shown = [r for r in rows if bool(r.get("warmup")) == warm]
            ax.plot([r["step"] for r in shown], [r[key] * scale for r in shown], marker,
                    markerfacecolor="none" if warm else None, color="C0", markersize=4)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(title + " (hollow: steps the timing summary leaves out)", fontsize=10)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100, pil_kwargs={"compress_level": 1})
    return path


__all__ = ["OutputError", "check_run_dir", "environment", "plot_curves", "write_run_folder"]
