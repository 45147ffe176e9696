"""Predict past measurements again with today's model.

A bench result stores the prediction its plans were chosen with. When the profile or the model
changes (compiled-kernel surfaces, a refitted engine term), the question is how well the model
*now* predicts what was measured then: the accuracy gate and the engine-term fit both ask it.
The plan, model graph (module facts as they were; older results: today's zoo), preset, batch,
GPU count and engine kind are all in the result, so the prediction is recomputed exactly as
`mosaic plan` would make it for that engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mosaic.graph import MMGraph
from mosaic.hardware import GPUS, make_cluster
from mosaic.plan import Plan, PlanError
from mosaic.profile.db import default_db_path


def hardware_of(report: dict[str, Any]) -> str | None:
    """The GPU kind of a result ('NVIDIA H200' -> 'h200'), None when mosaic has no spec."""
    words = str(report.get("hardware", "")).lower().replace("-", " ").split()
    return next((w for w in reversed(words) if w in GPUS), None)


class Repredictor:
    """Today's profiled model, one per (hardware, GPU count, engine kind, accumulation), on
    one ProfileDB."""

    def __init__(self, db: str | Path | None = None) -> None:
        self.db = db
        self._models: dict[tuple[str, int, str, int], Any] = {}
        self._graphs: dict[tuple, MMGraph] = {}

    def _model(self, hardware: str, num_gpus: int, engine: str, accumulation: int = 1) -> Any:
        from mosaic.perf.profiled import ProfiledModel

        key = (hardware, num_gpus, engine, accumulation)
        if key not in self._models:
            self._models[key] = ProfiledModel(
                make_cluster(num_gpus, hardware), self.db or default_db_path(hardware),
                engine=engine).accumulating(accumulation)
        return self._models[key]

    def graph(self, report: dict[str, Any]) -> MMGraph:
        from mosaic.perf.results import graph_of

        return graph_of(report, self._graphs)

    def predict(self, report: dict[str, Any], row: dict[str, Any], *,
                engine_term: bool = True, sequential: bool = False) -> float | None:
        """Seconds per iteration of `row`'s plan (`sequential`: of its placements run one
        after another); None for rows without a plan (user programs) or results this model
        cannot place (unknown GPU, a plan format it cannot read)."""
        resolved = self.resolve(report, row, sequential=sequential)
        if resolved is None:
            return None
        model, plan, graph = resolved
        return (model.iteration_time_s(plan, graph) if engine_term
                else model.composed_time_s(plan, graph))

    def resolve(self, report: dict[str, Any], row: dict[str, Any], *,
                sequential: bool = False) -> tuple[Any, Plan, MMGraph] | None:
        """Today's profiled model for `row`'s engine, its plan and the graph it ran; None as
        for `predict`."""
        from mosaic.perf.engine_term import engine_kind, row_engine, sequential_plan

        hardware = hardware_of(report)
        if not row.get("plan") or hardware is None:
            return None
        try:
            plan = Plan.from_dict(row["plan"])
        except (PlanError, ValueError):
            return None
        engine = row_engine(report, row) or {}
        if sequential:
            plan = sequential_plan(plan)
        model = self._model(hardware, plan.num_gpus, engine_kind(engine, report.get("gpus")),
                            int(engine.get("accumulation", 1)))
        return model, plan, self.graph(report)

    def predict_plan(self, hardware: str, engine: str, plan: Plan, graph: MMGraph, *,
                     engine_term: bool = True, accumulation: int = 1) -> float:
        """Seconds per iteration of `plan` on `engine` (an engine_term.engine_kind), with
        `accumulation` micro-steps per optimizer step."""
        model = self._model(hardware, plan.num_gpus, engine, accumulation)
        return (model.iteration_time_s(plan, graph) if engine_term
                else model.composed_time_s(plan, graph))
