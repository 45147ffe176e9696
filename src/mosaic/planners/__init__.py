"""Planners by name: pure functions (graph, cluster, perf model) -> validated, predicted Plan."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from mosaic.graph import MMGraph
from mosaic.hardware import ClusterSpec
from mosaic.perf.base import PerfModel
from mosaic.plan import Plan, PlanError
from mosaic.planners.distmm import plan_distmm
from mosaic.planners.exhaustive import plan_exhaustive
from mosaic.planners.gahc import plan_gahc
from mosaic.planners.megatron import plan_megatron
from mosaic.planners.mosaic import MosaicPlannerConfig, plan_mosaic
from mosaic.planners.spindle import plan_spindle
from mosaic.planners.variants import plan_mosaic_partition, plan_mosaic_tp, plan_mosaic_unaware

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
    planners = [get_planner(n) for n in names]
    plans, errors = [], []
    for name, planner in zip(names, planners, strict=True):
        try:
            plans.append(run_planner(planner, graph, cluster, perf))
        except PlanError as exc:
            errors.append(f"{name}: {exc}")
    if not plans:
        raise PlanError(f"no planner found a plan: {'; '.join(errors)}")
    return plans


def make_plan(graph: MMGraph, cluster: ClusterSpec, planner: str = "mosaic",
              perf_model: str | PerfModel = "auto", profile_db: str | Path | None = None) -> Plan:
    """THE way a plan is made, for `mosaic plan`, `bench` and `train` alike: the named planner
    with the named performance model (`auto`: the measured profile, `profile_db` or the one
    shipped, where one exists)."""
    from mosaic.perf import make_perf_model

    perf = perf_model if isinstance(perf_model, PerfModel) else make_perf_model(
        perf_model, cluster, preset=graph.preset, db=profile_db)
    return run_planner(get_planner(planner), graph, cluster, perf)


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
    return micro, copy.copy(perf).accumulating(1)
