"""Timelines of a plan: predicted (from a perf model) or measured (from the engine).

One event list feeds both the Gantt PNG (GPUs on the y-axis, modules as bars whose height is
their SM share) and the Chrome trace (opens in Perfetto).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mosaic.files import atomic_path, write_text_atomic
from mosaic.graph import MMGraph
from mosaic.perf.base import PerfModel
from mosaic.plan import Plan


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    module: str
    stage: int
    gpu: int
    start_s: float
    end_s: float
    sm_share: float
    lane: float = 0.0
    """Vertical offset inside the GPU's row (0..1), so concurrent bars do not hide each other."""
    phase: str = "fwd+bwd"
    bar: float | None = None
    """The bar's height in the Gantt chart where it is not `sm_share` (bars that share a GPU
    without quotas, stacked); the Chrome trace reports the plan's `sm_share`."""

    @property
    def height(self) -> float:
        return self.sm_share if self.bar is None else self.bar


ALL_REDUCE = "(gradient all-reduce)"
TAIL = "(transfers + optimizer)"


def predicted_timeline(plan: Plan, graph: MMGraph, perf: PerfModel) -> list[TimelineEvent]:
    """Every predicted second as a bar, so the bars end at the predicted iteration time: each
    stage's compute, its gradient all-reduce, then activation transfers and the optimizer."""
    events: list[TimelineEvent] = []
    t0 = 0.0
    for index, stage in enumerate(plan.stages):
        by_gpu = perf.stage_works(stage, graph)
        for gpu, works in sorted(by_gpu.items()):
            events.extend(_gpu_events(index, gpu, works, stage.sharing, t0, perf))
        compute_s, stage_s = perf.stage_compute_s(stage, graph), perf.stage_time_s(stage, graph)
        if stage_s > compute_s:
            events += [TimelineEvent(ALL_REDUCE, index, gpu, t0 + compute_s, t0 + stage_s, 1.0)
                       for gpu in sorted(by_gpu)]
        t0 += stage_s
    tail_s = (plan.predicted_iteration_s or perf.iteration_time_s(plan, graph)) - t0
    if tail_s > 0:
        events += [TimelineEvent(TAIL, len(plan.stages), gpu, t0, t0 + tail_s, 1.0)
                   for gpu in range(plan.num_gpus)]
    return events


def _gpu_events(stage: int, gpu: int, works, sharing: str, t0: float, perf: PerfModel):
    if sharing == "temporal" or len(works) == 1:
        start = t0
        for w in works:
            duration = perf.work_time_s(w, 1.0)  # a TP shard's too
            yield TimelineEvent(w.module.name, stage, gpu, start, start + duration, 1.0)
            start += duration
        return
    group_s = perf.colocated_time_s(works, sharing)
    lane = 0.0
    for w in works:
        bar = w.sm_share if sharing in ("partition", "cap") else 1.0 / len(works)
        alone = perf.work_time_s(w, w.sm_share if sharing != "free" else 1.0)
        duration = min(group_s, alone) if sharing != "partition" else group_s
        yield TimelineEvent(w.module.name, stage, gpu, t0, t0 + duration, w.sm_share, lane,
                            bar=bar)
        lane = min(1.0, lane + bar)


def plot_timeline(events: list[TimelineEvent], path: str | Path, title: str) -> Path:
    # The object API on the Agg canvas, not pyplot: no GUI backend to pick, no global figure
    # registry to close, and about a second less to import on a small machine.
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    names = sorted({e.module for e in events} - {ALL_REDUCE, TAIL})
    colours = {n: colormaps["tab20"](i % 20) for i, n in enumerate(names)}
    colours.update({ALL_REDUCE: "0.55", TAIL: "0.8"})  # greys: not a module's compute
    names += [n for n in (ALL_REDUCE, TAIL) if any(e.module == n for e in events)]
    gpus = sorted({e.gpu for e in events})
    # Fixed margins in inches (title above; tick labels, axis label and legend rows below)
    # instead of tight_layout, whose extra layout pass was a third of each PNG's time.
    legend_rows = -(-len(names) // 6)
    top_in, bottom_in = 0.45, 0.6 + 0.25 * legend_rows
    height = top_in + bottom_in + 0.3 + 0.45 * len(gpus)
    fig = Figure(figsize=(10, height))
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.08, right=0.98, top=1 - top_in / height, bottom=bottom_in / height)
    ax = fig.subplots()
    for e in events:
        y = e.gpu + e.lane * 0.9
        ax.broken_barh([(e.start_s * 1e3, (e.end_s - e.start_s) * 1e3)], (y, e.height * 0.9),
                       facecolors=colours[e.module], edgecolor="black", linewidth=0.3)
    ax.set_yticks([g + 0.45 for g in gpus], [f"GPU {g}" for g in gpus])
    ax.set_xlabel("time in one iteration (ms); bar height = SM share (stacked where shared)")
    ax.set_title(title)
    ax.invert_yaxis()
    handles = [Rectangle((0, 0), 1, 1, color=colours[n]) for n in names]
    fig.legend(handles, names, loc="lower center", ncol=min(len(names), 6), fontsize=8,
               frameon=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:  # zlib level 1: a quarter of level 6's time, a few kB more
        fig.savefig(tmp, dpi=110, pil_kwargs={"compress_level": 1})
    return path


def chrome_trace(events: list[TimelineEvent]) -> dict:
    """Chrome trace-event JSON: one process per GPU, one thread per module."""
    trace = [
        {
            "name": e.module, "cat": e.phase, "ph": "X", "pid": e.gpu, "tid": e.module,
            "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6,
            "args": {"stage": e.stage, "sm_share": e.sm_share},
        }
        for e in events
    ]
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(events: list[TimelineEvent], path: str | Path) -> Path:
    return write_text_atomic(path, json.dumps(chrome_trace(events)))
