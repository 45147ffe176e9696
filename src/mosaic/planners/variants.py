"""Ablation planners: the mosaic search in a smaller world, re-predicted by the real model.

- `mosaic-partition`: the paper's plan space: colocated modules only as disjoint SM
  partitions (no free streams, no caps, no back-to-back colocation on a GPU).
- `mosaic-unaware`: plans chosen by the interference-unaware profiled model (the paper's
  ablation of its non-linear interference term).
- `mosaic-tp`: the other way, a larger world: mosaic that also tries tensor parallelism where
  the model predicts it faster (MosaicPlannerConfig.tensor_parallel='faster').

Both search with a restricted model, then the chosen plan's prediction comes from the model
the caller passed, so the ablation compares plans, not models.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from mosaic.graph import MMGraph, ModuleSpec
from mosaic.hardware import ClusterSpec
from mosaic.perf.base import PerfModel, Work
from mosaic.plan import Plan, PlanError
from mosaic.planners.mosaic import MosaicPlannerConfig, plan_mosaic


class OnlyModes(PerfModel):
    """`inner`, except that colocating in a mode outside `modes` costs infinite time."""

    def __init__(self, inner: PerfModel, modes: Sequence[str]) -> None:
        super().__init__(inner.cluster)
        self.inner, self.modes = inner, tuple(modes)
        self.name = f"{inner.name}[{'/'.join(self.modes)}]"
        self.optimizer_bytes_per_param = inner.optimizer_bytes_per_param
        self.accumulation, self.micro_step_of = inner.accumulation, inner.micro_step_of
        self.grad_wire_bytes, self.sums_in_backward = inner.grad_wire_bytes, inner.sums_in_backward

    def optimizer_step_s(self, num_params: float) -> float:
        return self.inner.optimizer_step_s(num_params)

    def module_time_s(self, module: ModuleSpec, per_gpu_batch: int, sm_share: float = 1.0) -> float:
        return self.inner.module_time_s(module, per_gpu_batch, sm_share)

    def colocated_time_s(self, works: Sequence[Work], sharing: str) -> float:
        if len(works) > 1 and sharing not in self.modes:
            return math.inf
        return self.inner.colocated_time_s(works, sharing)

    def allreduce_s(self, num_bytes: float, gpus: Sequence[int]) -> float:
        return self.inner.allreduce_s(num_bytes, gpus)

    def collective_s(self, kind: str, num_bytes: float, gpus: Sequence[int]) -> float:
        return self.inner.collective_s(kind, num_bytes, gpus)

    def transfer_s(self, num_bytes: float, src_gpus: Sequence[int], dst_gpus: Sequence[int]) -> float:
        return self.inner.transfer_s(num_bytes, src_gpus, dst_gpus)


def _relabel(plan: Plan, label: str, graph: MMGraph, perf: PerfModel) -> Plan:
    plan = replace(plan, planner=label, meta={**plan.meta, "searched_with": plan.perf_model})
    return perf.predict(plan, graph)


def plan_mosaic_partition(graph: MMGraph, cluster: ClusterSpec, perf: PerfModel) -> Plan:
    return _relabel(plan_mosaic(graph, cluster, OnlyModes(perf, ("partition",))),
                    "mosaic-partition", graph, perf)


def plan_mosaic_unaware(graph: MMGraph, cluster: ClusterSpec, perf: PerfModel) -> Plan:
    from mosaic.perf.profiled import ProfiledModel

    if not isinstance(perf, ProfiledModel):
        raise PlanError("mosaic-unaware needs the profiled performance model (--perf-model profiled)")
    unaware = ProfiledModel(cluster, perf.db_path, interference="unaware", engine=perf.engine
                            ).accumulating(perf.accumulation)
    return _relabel(plan_mosaic(graph, cluster, unaware), "mosaic-unaware", graph, perf)


def plan_mosaic_tp(graph: MMGraph, cluster: ClusterSpec, perf: PerfModel) -> Plan:
    plan = plan_mosaic(graph, cluster, perf, MosaicPlannerConfig(tensor_parallel="faster"))
    return replace(plan, planner="mosaic-tp")
