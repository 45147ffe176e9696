"""From search-space stages to a concrete Plan: GPU ids, priorities, memory, exact cost.

Blocks go largest first onto the lowest free run of GPUs that stays inside one node when the
block fits a node (its all-reduce then uses NVLink), so the largest block of every stage
starts at GPU 0 and same-sized producer and consumer blocks coincide (nothing to transfer).
"""

from __future__ import annotations

from collections.abc import Sequence

from mosaic.plan import (
    MemoryPlanError,
    Placement,
    Plan,
    Stage,
    gpu_memory_bytes,
    memory_fix,
)
from mosaic.planners.common import INF, Block, SearchSpace, StageChoice

Placed = list[tuple[Block, tuple[int, ...]]]


def assemble(space: SearchSpace, stages: Sequence[StageChoice], planner: str,
             balance_memory: bool = False, meta: dict | None = None) -> Plan:
    """Give every block concrete GPU ids and build the predicted (not yet validated) Plan.

    With `balance_memory`, stages are placed heaviest first and a block takes the run whose
    fullest GPU (over the stages placed so far) is emptiest.
    """
    order = list(range(len(stages)))
    used = [0.0] * space.num_gpus if balance_memory else None
    if balance_memory:
        order.sort(key=lambda i: -max(space.module_bytes(m, b.size) for b in stages[i].blocks for m in b.modules))
    placed = {i: place_stage(space, stages[i], used) for i in order}
    plan_stages = tuple(_stage(space, stages[i].sharing, placed[i]) for i in range(len(stages)))
    plan = Plan(model=space.graph.name, planner=planner, num_gpus=space.num_gpus,
                stages=plan_stages, meta=dict(meta or {}))
    return space.perf.predict(plan, space.graph)


def place_stage(space: SearchSpace, stage: StageChoice, used: list[float] | None = None
                ) -> Placed:
    """GPU ids for each block of a stage; `used` (bytes per GPU so far) is updated if given."""
    free, placed = set(range(space.num_gpus)), []
    for block in sorted(stage.blocks, key=lambda b: -b.size):
        gpus = _pick_gpus(space, block, free, used)
        free -= set(gpus)
        if used is not None:
            for g in gpus:
                used[g] += sum(space.module_bytes(m, block.size) for m in block.modules)
        placed.append((block, gpus))
    return placed


def _pick_gpus(space: SearchSpace, block: Block, free: set[int], used: list[float] | None
               ) -> tuple[int, ...]:
    per_node, size = space.cluster.gpus_per_node, block.size
    # Free runs by their first GPU, from a prefix count of free GPUs: O(GPUs) per block, not
    # O(GPUs x size) (which dominated planning at 1024 GPUs).
    prefix = [0]
    for g in range(space.num_gpus):
        prefix.append(prefix[-1] + (g in free))
    runs = [p for p in range(space.num_gpus - size + 1) if prefix[p + size] - prefix[p] == size]
    inside = [p for p in runs if size > per_node or p // per_node == (p + size - 1) // per_node]
    # A block larger than a node should start on a node boundary, so it spans as few as possible.
    aligned = [p for p in inside if size <= per_node or p % per_node == 0]
    candidates = aligned or inside or runs
    if not candidates:  # fragmented: any free GPUs (the stage still fits, sizes sum <= GPUs)
        return tuple(sorted(free)[:size])
    if used is None:
        return tuple(range(candidates[0], candidates[0] + size))
    start = min(candidates, key=lambda p: (max(used[p:p + size]), p))
    return tuple(range(start, start + size))


def _stage(space: SearchSpace, sharing: str, placed: Placed) -> Stage:
    placements = []
    for block, gpus in placed:
        critical = space.critical_module(block.modules, block.size, sharing)
        for m, share in zip(block.modules, block.sm_shares, strict=True):
            placements.append(Placement(module=m, gpus=gpus, sm_share=share,
                                        priority=int(m == critical),
                                        tensor_parallel=space.tp_of(m),
                                        shard=space.shards(m, block.size),
                                        shard_degree=space.shard_degree(m, block.size)))
    return Stage(placements=tuple(placements), sharing=sharing)


def memory_overflow(plan: Plan, space: SearchSpace) -> tuple[int, float] | None:
    """(GPU, bytes over the usable memory) of the fullest GPU, or None if the plan fits."""
    used = gpu_memory_bytes(plan, space.graph)
    gpu, need = max(used.items(), key=lambda kv: kv[1])
    return (gpu, need - space.budget_bytes) if need > space.budget_bytes else None


def fitting_plan(space: SearchSpace, stages: Sequence[StageChoice], planner: str,
                 meta: dict | None = None) -> Plan:
    """Assemble; if the packed GPU ids overflow memory, spread blocks by memory instead.

    Raises PlanError naming the fullest GPU and its modules when neither fits."""
    plan = assemble(space, stages, planner, meta=meta)
    if memory_overflow(plan, space) is None:
        return plan
    plan = assemble(space, stages, planner, balance_memory=True, meta=meta)
    over = memory_overflow(plan, space)
    if over is not None:
        gpu, excess = over
        names = sorted({p.module for s in plan.stages for p in s.placements if gpu in p.gpus})
        raise MemoryPlanError(
            f"{planner}: GPU {gpu} holds {names} and needs {excess / 2**30:.1f} GiB more than the "
            f"{space.budget_bytes / 2**30:.1f} GiB usable on {space.cluster.gpu.name}; "
            f"{memory_fix(plan, space.graph, gpu, excess)}"
        )
    return plan


def finish(plan: Plan, space: SearchSpace) -> Plan:
    """The one exit of every planner: a validated plan carrying its predicted time."""
    plan.validate(space.graph, space.cluster)
    if plan.predicted_iteration_s is None:
        plan = space.perf.predict(plan, space.graph)
    return plan


class PlanCoster:
    """Exact predicted iteration time of a stage sequence without building a Plan: stage
    times + activation transfers between the canonical GPU ids + the optimizer step (where
    the perf model adds one); inf if memory overflows."""

    def __init__(self, space: SearchSpace) -> None:
        self.space = space
        self._placed: dict[StageChoice, tuple[dict[str, tuple[int, ...]], tuple[float, ...], tuple[float, ...]]] = {}

    def placed(self, stage: StageChoice) -> tuple[dict[str, tuple[int, ...]], tuple[float, ...], tuple[float, ...]]:
        """GPU ids per module, and bytes and parameters per GPU, of the canonical placement."""
        if stage not in self._placed:
            used, params = [0.0] * self.space.num_gpus, [0.0] * self.space.num_gpus
            gpus = {}
            for block, ids in place_stage(self.space, stage):
                for g in ids:
                    used[g] += sum(self.space.module_bytes(m, block.size) for m in block.modules)
                    params[g] += sum(self.space.optimizer_params(m, block.size)
                                     for m in block.modules)
                gpus.update((m, ids) for m in block.modules)
            self._placed[stage] = (gpus, tuple(used), tuple(params))
        return self._placed[stage]

    def transfers_s(self, stages: Sequence[StageChoice]) -> float:
        space = self.space
        gpus = {m: ids for s in stages for m, ids in self.placed(s)[0].items()}
        total = 0.0
        for src, dst in space.graph.edges:
            total += space.placed_transfer_s(src, dst, gpus[src], gpus[dst])
        return total

    def optimizer_s(self, stages: Sequence[StageChoice]) -> float:
        """As `PerfModel.optimizer_s`: the GPU holding the most parameters steps last."""
        most = max(sum(v) for v in zip(*(self.placed(s)[2] for s in stages), strict=True))
        return self.space.perf.optimizer_step_s(most) / self.space.perf.micro_step_of

    def overflow_bytes(self, stages: Sequence[StageChoice]) -> float:
        """Bytes the fullest GPU needs beyond the usable memory (<= 0: the plan fits)."""
        per_gpu = [sum(v) for v in zip(*(self.placed(s)[1] for s in stages), strict=True)]
        return max(per_gpu) - self.space.budget_bytes

    def fits(self, stages: Sequence[StageChoice]) -> bool:
        return self.overflow_bytes(stages) <= 0

    def total_s(self, stages: Sequence[StageChoice]) -> float:
        if not self.fits(stages):
            return INF
        return sum(s.time_s for s in stages) + self.transfers_s(stages) + self.optimizer_s(stages)
