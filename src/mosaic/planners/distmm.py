"""DistMM style baseline: the independent modules of each DAG level run at once on disjoint
whole-GPU sets sized to balance their times; dependents follow on the next level.

A level with more modules than GPUs packs several modules per GPU set, run one after the
other (temporal), by longest-processing-time-first onto as many sets as there are GPUs.
"""

from __future__ import annotations

from mosaic.graph import MMGraph
from mosaic.hardware import ClusterSpec
from mosaic.perf.base import PerfModel
from mosaic.plan import Plan, PlanError
from mosaic.planners.assembly import finish, fitting_plan
from mosaic.planners.common import SearchSpace, StageChoice, check_modules_fit
from mosaic.planners.shard_fallback import plan_fitting
from mosaic.planners.sizing import size_groups


def lpt_groups(space: SearchSpace, modules: list[str], num_groups: int) -> list[tuple[str, ...]]:
    """Longest-processing-time-first: each module joins the group that is least loaded so far."""
    loads = [0.0] * num_groups
    groups: list[list[str]] = [[] for _ in range(num_groups)]
    for m in sorted(modules, key=lambda m: -space.module_s(m, 1)):
        i = loads.index(min(loads))
        groups[i].append(m)
        loads[i] += space.module_s(m, 1)
    return [tuple(g) for g in groups if g]


def level_stage(space: SearchSpace, modules: list[str]) -> StageChoice:
    """Whole GPUs per module (or per LPT pack), GPU counts by the exact min-max choice; fewer
    packs when memory or the batch's divisors leave no room for one set per module."""
    for num_groups in range(min(len(modules), space.num_gpus), 0, -1):
        groups = [(m,) for m in modules] if num_groups == len(modules) else lpt_groups(
            space, modules, num_groups)
        stage = size_groups(space, groups, "temporal")
        if stage is not None:
            return stage
    raise PlanError(f"distmm: modules {modules} do not fit {space.num_gpus} GPUs even one after "
                    "another; use more GPUs or lower global_batch")


def distmm_stages(space: SearchSpace) -> list[StageChoice]:
    return [level_stage(space, level) for level in space.graph.levels()]


def plan_distmm(graph: MMGraph, cluster: ClusterSpec, perf: PerfModel) -> Plan:
    return plan_fitting(SearchSpace(graph, cluster, perf), _plan_in)


def _plan_in(space: SearchSpace) -> Plan:
    check_modules_fit(space)
    return finish(fitting_plan(space, distmm_stages(space), "distmm"), space)
