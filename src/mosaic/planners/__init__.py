"""Planners by name: pure functions (graph, cluster, perf model) -> validated, predicted Plan."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from mosaic.graph import MMGraph
from mosaic.hardware import ClusterSpec
from mosaic.perf.base import PerfModel
from mosaic.plan import MemoryPlanError, Plan, PlanError
from mosaic.planners.distmm import plan_distmm
from mosaic.planners.exhaustive import plan_exhaustive
from mosaic.planners.gahc import plan_gahc
from mosaic.planners.megatron import plan_megatron
from mosaic.planners.mosaic import MosaicPlannerConfig, plan_mosaic
from mosaic.planners.spindle import plan_spindle
from mosaic.planners.variants import plan_mosaic_partition, plan_mosaic_tp, plan_mosaic_unaware
from mosaic.tensor_parallel import bf16_precision_saving

Planner = Callable[[MMGraph, ClusterSpec, PerfModel], Plan]

PLANNERS: dict[str, Planner] = {
    "megatron": plan_megatron,
    "distmm": plan_distmm,
    "spindle": plan_spindle,
    "mosaic": plan_mosaic,
    "exhaustive": plan_exhaustive,
    "gahc": plan_gahc,
    "mosaic-partition": plan_mosaic_partition,  # ablation: the paper's plan space
    "mosaic-unaware": plan_mosaic_unaware,  # ablation: no interference term
    "mosaic-tp": plan_mosaic_tp,  # also tensor parallelism where predicted faster
}

__all__ = ["PLANNERS", "MosaicPlannerConfig", "get_planner", "make_plan", "one_micro_step",
           "plan_all", "plan_mosaic", "run_planner"]


def get_planner(name: str) -> Planner:
    try:
        return PLANNERS[name]
    except KeyError:
        raise PlanError(f"unknown planner {name!r}; choose from {', '.join(PLANNERS)}") from None


def plan_all(graph: MMGraph, cluster: ClusterSpec, perf: PerfModel,
             names: Sequence[str] = ("megatron", "distmm", "spindle", "mosaic")) -> list[Plan]:
    """Every named planner's validated, predicted plan, in the order given.

    A baseline whose plan cannot fit (PlanError) is left out, since the others still compare;
    if no planner produces a plan, the first error is raised.
    """
    plans, errors = _each_plan(graph, cluster, perf, names)
    if not plans:
        message = f"no planner found a plan: {'; '.join(str(e) for e in errors)}"
        if any(isinstance(e, MemoryPlanError) for e in errors):
            message += lean_precision_hint(
                graph, message, lambda lean: _each_plan(lean, cluster, perf, names)[0])
        raise PlanError(message)
    return plans


def _each_plan(graph: MMGraph, cluster: ClusterSpec, perf: PerfModel,
               names: Sequence[str]) -> tuple[list[Plan], list[PlanError]]:
    plans, errors = [], []
    for name in names:
        try:
            plans.append(run_planner(get_planner(name), graph, cluster, perf))
        except PlanError as exc:  # named once (the assembly names its planner itself)
            text = str(exc) if str(exc).startswith(f"{name}: ") else f"{name}: {exc}"
            errors.append(MemoryPlanError(text) if isinstance(exc, MemoryPlanError)
                          else PlanError(text))
    return plans, errors


def lean_precision_hint(graph: MMGraph, message: str,
                        plans_of: Callable[[MMGraph], list[Plan]]) -> str:
    """'; a plan fits with `mosaic train FLAGS`' where the graph held with bf16 weights and
    moments, updated a weight at a time (then without fp32 main weights too), gets a plan from
    `plans_of` that the engine can train so (whole modules: it keeps bf16 weights on no
    sharded or tensor-parallel one), and `message` does not already name those flags; else
    ''. A module's memory check sees the module alone: the flags it names can leave the GPU
    its modules share short, so the user would learn the rest only from a second error."""
    for main_weights in (True, False):  # the fp32 main copies are the last to go
        flags = next((f for m in graph.modules
                      if (f := bf16_precision_saving(m, main_weights=main_weights)[1])), "")
        if not flags:
            continue
        lean = graph.with_precision(bf16_weights=True, bf16_moments=True, bf16_flat_grads=False,
                                    fp32_main_weights=main_weights and all(
                                        m.fp32_main_weights for m in graph.modules))
        try:
            plans = plans_of(lean)
        except PlanError:
            continue
        if any(_whole_modules(p) for p in plans):
            return "" if f"train with {flags} " in message else (
                f"; a plan fits with `mosaic train {flags}`")
    return ""


def _whole_modules(plan: Plan) -> bool:
    return not any(p.shard or p.tensor_parallel > 1
                   for stage in plan.stages for p in stage.placements)


def make_plan(graph: MMGraph, cluster: ClusterSpec, planner: str = "mosaic",
              perf_model: str | PerfModel = "auto", profile_db: str | Path | None = None) -> Plan:
    """THE way a plan is made, for `mosaic plan`, `bench` and `train` alike: the named planner
    with the named performance model (`auto`: the measured profile, `profile_db` or the one
    shipped, where one exists)."""
    from mosaic.perf import make_perf_model

    perf = perf_model if isinstance(perf_model, PerfModel) else make_perf_model(
        perf_model, cluster, preset=graph.preset, db=profile_db)
    chosen = get_planner(planner)
    try:
        return run_planner(chosen, graph, cluster, perf)
    except MemoryPlanError as error:
        hint = lean_precision_hint(graph, str(error),
                                   lambda lean: [run_planner(chosen, lean, cluster, perf)])
        if not hint:
            raise
        raise MemoryPlanError(f"{error}{hint}") from None


def run_planner(planner: Planner, graph: MMGraph, cluster: ClusterSpec,
                perf: PerfModel) -> Plan:
    """`planner`'s plan of `graph`. Where `perf` predicts gradient accumulation (K micro-steps
    per step), the plan is searched for one micro-step, global_batch / K: that is what must
    fit in memory (the point of accumulating) and what the schedule runs K times; it is then
    predicted for the whole accumulated step."""
    if perf.accumulation == 1:
        return planner(graph, cluster, perf)
    micro, per_micro_step = one_micro_step(graph, perf)
    return perf.predict(planner(micro, cluster, per_micro_step), graph)


def one_micro_step(graph: MMGraph, perf: PerfModel) -> tuple[MMGraph, PerfModel]:
    """The graph and model of one micro-step where `perf` accumulates (run_planner)."""
    micro_steps = perf.accumulation
    if graph.global_batch % micro_steps:
        raise PlanError(f"accumulation={micro_steps} must divide global_batch "
                        f"{graph.global_batch}")
    micro = replace(graph, global_batch=graph.global_batch // micro_steps)
    per_micro_step = copy.copy(perf).accumulating(1)
    per_micro_step.micro_step_of = micro_steps
    return micro, per_micro_step
