"""Spindle style baseline: wavefront scheduling with whole GPUs, balanced across waves.

Every wave aims at one common duration: ready modules, most critical first, each take the
fewest whole GPUs that finish them within it, while GPUs remain; a module that does not fit
waits for a later wave (even when it is ready), where it balances that wave instead. Waves
mix DAG levels. The common duration is swept over the modules' own times and the best
schedule (exact predicted time) kept; each wave's GPU counts are set by `size_groups`.
"""

from __future__ import annotations

from functools import cache

from mosaic.graph import MMGraph
from mosaic.hardware import ClusterSpec
from mosaic.perf.base import PerfModel
from mosaic.plan import Plan
from mosaic.planners.assembly import PlanCoster, finish, fitting_plan
from mosaic.planners.common import INF, SearchSpace, StageChoice, check_modules_fit
from mosaic.planners.shard_fallback import plan_fitting
from mosaic.planners.sizing import size_groups

NUM_TARGETS = 24
"""Wave durations tried: quantiles of the modules' own (time, GPU count) choices."""


def _alone_s(space: SearchSpace, m: str, k: int) -> float:
    return space.block_s((m,), k, "temporal") + space.allreduce_s(m, k) if space.fits((m,), k) else INF


def _critical_path_s(space: SearchSpace) -> dict[str, float]:
    """Longest remaining path (fastest time of each module) from a module to a sink."""
    graph = space.graph

    @cache
    def path(m: str) -> float:
        own = min(_alone_s(space, m, k) for k in space.sizes)
        return own + max((path(s) for s in graph.successors(m)), default=0.0)

    return {m: path(m) for m in graph.names}


def _wave(space: SearchSpace, ready: list[str], target_s: float) -> list[str]:
    wave, used = [], 0
    for m in ready:
        sizes = [k for k in space.sizes if _alone_s(space, m, k) <= target_s]
        if not sizes and not wave:  # nothing meets the target: the first module runs anyway
            sizes = [min(space.sizes, key=lambda k: _alone_s(space, m, k))]
        if sizes and used + sizes[0] <= space.num_gpus:
            wave.append(m)
            used += sizes[0]
    return wave


def waves_for(space: SearchSpace, target_s: float, critical: dict[str, float],
              exact: bool = False) -> list[StageChoice] | None:
    graph, done, stages = space.graph, set(), []
    while len(done) < len(graph.names):
        ready = [m for m in graph.names if m not in done and set(graph.predecessors(m)) <= done]
        ready.sort(key=lambda m: (-critical[m], m))
        wave = _wave(space, ready, target_s)
        stage = size_groups(space, [(m,) for m in wave], "temporal", exact=exact)
        if stage is None:
            return None
        stages.append(stage)
        done |= set(wave)
    return stages


def spindle_stages(space: SearchSpace) -> list[StageChoice]:
    critical = _critical_path_s(space)
    times = sorted({t for m in space.graph.names for k in space.sizes
                    if (t := _alone_s(space, m, k)) < INF})
    step = max(1, len(times) // NUM_TARGETS)
    coster, best_target, best_s = PlanCoster(space), times[-1], INF
    for target_s in times[::step] + times[-1:]:  # GPU counts of the sweep: fast path only
        stages = waves_for(space, target_s, critical)
        if stages is not None and (total_s := coster.total_s(stages)) < best_s:
            best_target, best_s = target_s, total_s
    stages = waves_for(space, best_target, critical, exact=True)
    assert stages is not None, "a sweep's waves fit, so their exact sizing does"
    return stages


def plan_spindle(graph: MMGraph, cluster: ClusterSpec, perf: PerfModel) -> Plan:
    return plan_fitting(SearchSpace(graph, cluster, perf), _plan_in)


def _plan_in(space: SearchSpace) -> Plan:
    check_modules_fit(space)
    return finish(fitting_plan(space, spindle_stages(space), "spindle"), space)
