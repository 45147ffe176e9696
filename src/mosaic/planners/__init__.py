"""Planners by name: pure functions (graph, cluster, perf model) -> validated, predicted Plan."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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

__all__ = ["PLANNERS", "MosaicPlannerConfig", "get_planner", "make_plan", "plan_all",
           "plan_mosaic"]


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
            plans.append(planner(graph, cluster, perf))
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
    return get_planner(planner)(graph, cluster, perf)
