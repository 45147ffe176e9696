"""Megatron-LM style baseline: every module data-parallel over all GPUs, one after another."""

from __future__ import annotations

from mosaic.graph import MMGraph
from mosaic.hardware import ClusterSpec
from mosaic.perf.base import PerfModel
from mosaic.plan import Plan
from mosaic.planners.assembly import finish, fitting_plan
from mosaic.planners.common import SearchSpace, check_modules_fit
from mosaic.planners.shard_fallback import plan_fitting
from mosaic.planners.sizing import stage_of_singletons


def megatron_stages(space: SearchSpace) -> list:
    """One temporal stage per module in topological order, each on the largest DP degree
    that divides the batch (all GPUs when the batch allows; whole TP replicas)."""
    return [stage_of_singletons(space, [m], "temporal", [space.sizes_of(m)[-1]])
            for m in space.graph.topo_order()]


def plan_megatron(graph: MMGraph, cluster: ClusterSpec, perf: PerfModel) -> Plan:
    return plan_fitting(SearchSpace(graph, cluster, perf), _plan_in)


def _plan_in(space: SearchSpace) -> Plan:
    check_modules_fit(space)
    return finish(fitting_plan(space, megatron_stages(space), "megatron"), space)
