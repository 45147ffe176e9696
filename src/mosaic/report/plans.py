"""Plan artifacts on disk (plan JSON, Gantt PNG, Chrome trace) and the summary `mosaic plan` prints."""

from __future__ import annotations

from pathlib import Path

from mosaic.graph import MMGraph
from mosaic.perf.base import PerfModel
from mosaic.plan import Plan
from mosaic.report.timeline import plot_timeline, predicted_timeline, write_chrome_trace


def write_plan_artifacts(plans: list[Plan], graph: MMGraph, perf: PerfModel, out: Path) -> dict[str, Path]:
    """Per plan: <planner>.json, <planner>.png (Gantt), <planner>.trace.json; returns the JSON paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    for plan in plans:
        files[plan.planner] = plan.save(out / f"{plan.planner}.json")
        events = predicted_timeline(plan, graph, perf)
        title = (f"{graph.name} ({graph.preset}) on {plan.num_gpus} GPUs, {plan.planner}: "
                 f"{plan.predicted_iteration_s * 1e3:.1f} ms predicted")
        plot_timeline(events, out / f"{plan.planner}.png", title)
        write_chrome_trace(events, out / f"{plan.planner}.trace.json")
    return files


def plans_summary(plans: list[Plan], graph: MMGraph, perf: PerfModel, files: dict[str, Path],
                  hardware: str) -> dict:
    """The stable `--json` object of `mosaic plan`."""
    by_name = {p.planner: p for p in plans}
    # Only a ratio to a megatron plan that was made: a lone plan has nothing to compare with.
    reference = by_name["megatron"].predicted_iteration_s if "megatron" in by_name else None
    rows = []
    for plan in plans:
        rows.append({
            "planner": plan.planner,
            "predicted_iteration_s": plan.predicted_iteration_s,
            "predicted_gpu_util": perf.gpu_utilisation(plan, graph),
            "speedup_vs_megatron": (reference / plan.predicted_iteration_s
                                    if reference else None),
            "num_stages": len(plan.stages),
            "sharing": [s.sharing for s in plan.stages],
            "sharded": plan.sharded_modules(),
            "states_over": {p.module: p.states_over for s in plan.stages for p in s.placements
                            if p.shard},
            "tensor_parallel": {p.module: p.tensor_parallel for s in plan.stages
                                for p in s.placements if p.tensor_parallel > 1},
            "plan_file": str(files[plan.planner]),
        })
    return {
        "model": graph.name,
        "preset": graph.preset,
        "global_batch": graph.global_batch,
        "gpus": plans[0].num_gpus,
        "hardware": hardware,
        "perf_model": perf.describe(),
        "plans": rows,
    }
