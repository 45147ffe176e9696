"""What every planner shares: the discrete search space and its memoised costs.

The space all planners (baselines, mosaic, exhaustive, GAHC) search is the same, so their
plans are comparable:

- a plan is a sequence of stages; the modules of a stage are mutually independent;
- a stage has one sharing mode and a set of *blocks*: a block is a run of `size` GPUs on
  which a group of modules is colocated, each module replicated on every GPU of the block
  (DP degree = size, a divisor of the global batch); blocks of a stage are disjoint;
- a module may be tensor-parallel (mosaic.tensor_parallel): one degree t per module for the
  whole search (`SearchSpace.tp`), its replicas then span t GPUs of the block (DP degree =
  size / t); by default t is 1, or the least degree that lets a too-big module fit;
- partition / cap shares come from a grid: multiples of the hardware's SM granularity, or
  of a coarser `sm_step`, plus 1.0 (a whole GPU / uncapped).

GPU ids are assigned at the end (`assembly`): GPUs of a node are interchangeable, so only
node boundaries (all-reduce bandwidth), activation transfers and memory balance depend on
which ids a block gets.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from mosaic import sharding
from mosaic import tensor_parallel as tp
from mosaic.graph import MMGraph, ModuleSpec
from mosaic.hardware import ClusterSpec
from mosaic.perf.base import PerfModel, Work
from mosaic.plan import MEMORY_MARGIN, MemoryPlanError, replica_bytes

INF = math.inf
TRANSFER_CHARGE = 0.5
"""Share of an edge's estimated transfer charged to each of its two ends' stages."""


@dataclass(frozen=True, slots=True)
class Block:
    """Modules colocated on `size` GPUs; `sm_shares[i]` belongs to `modules[i]`."""

    modules: tuple[str, ...]
    size: int
    sm_shares: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class StageChoice:
    """One stage of the search space and its predicted time (compute + all-reduce)."""

    sharing: str
    blocks: tuple[Block, ...]
    time_s: float
    """Predicted stage time: slowest block's compute + slowest all-reduce."""
    penalty_s: float = 0.0
    """The search's stand-in for costs outside the stage that its layout causes (activation
    transfers, `SearchSpace.layout_penalty_s`)."""

    @property
    def cost_s(self) -> float:
        return self.time_s + self.penalty_s

    @property
    def modules(self) -> frozenset[str]:
        return frozenset(m for b in self.blocks for m in b.modules)


def share_grid(cluster: ClusterSpec, sm_step: float | None) -> tuple[float, ...]:
    """Increasing SM shares a quota may take; the last one is 1.0 (whole GPU / uncapped)."""
    gpu = cluster.gpu
    if sm_step is None:
        shares = [j * gpu.sm_granularity / gpu.num_sms for j in range(1, gpu.num_sm_groups + 1)]
    else:
        shares = [round(j * sm_step, 9) for j in range(1, int(1 / sm_step + 1e-9) + 1)]
    return tuple(sorted({s for s in shares if s < 1.0} | {1.0}))


class SearchSpace:
    """The graph, cluster and perf model of one search, with memoised (pure) costs.

    `evaluations` counts calls into the performance model, the unit the paper's search-cost
    comparison uses; set `use_cache=False` to pay for every repeated question (GAHC's
    uncached variant).
    """

    def __init__(self, graph: MMGraph, cluster: ClusterSpec, perf: PerfModel,
                 sm_step: float | None = None, use_cache: bool = True,
                 tensor_parallel: Mapping[str, int] | None = None) -> None:
        """`tensor_parallel`: module -> TP degree for the search (absent: 1); None: 1, or the
        least degree a module that fits no GPU otherwise needs (`needed_tensor_parallel`)."""
        self.graph, self.cluster, self.perf = graph, cluster, perf
        self.num_gpus = cluster.num_gpus
        self.tp: dict[str, int] = {}
        self.sizes = tuple(k for k in range(1, self.num_gpus + 1) if graph.global_batch % k == 0)
        self.shares = share_grid(cluster, sm_step)
        self.share_sms = tuple(cluster.gpu.round_sms(s) for s in self.shares)
        self.budget_bytes = cluster.gpu.memory_bytes * (1 - MEMORY_MARGIN)
        self.specs = {m.name: m for m in graph.modules}
        self._succ = {m: graph.successors(m) for m in graph.names}
        self._pred = {m: graph.predecessors(m) for m in graph.names}
        self._bytes: dict[tuple[str, int], float] = {}
        self._transfers: dict[tuple[str, int], float] = {}
        self.block_budget_bytes = self.budget_bytes
        """Bytes a block may use per GPU; lowered per stage when stages must share memory."""
        self.use_cache = use_cache
        self.evaluations = 0
        self._cache: dict[tuple, float] = {}
        self.sharded: frozenset[str] = frozenset()
        """Modules whose states are sharded wherever that saves memory (`set_sharded`)."""
        self.set_tensor_parallel(needed_tensor_parallel(self) if tensor_parallel is None
                                 else tensor_parallel)

    # --- tensor parallelism: one degree per module for the whole search ----------------------
    def set_tensor_parallel(self, degrees: Mapping[str, int]) -> None:
        """Search with these TP degrees (absent: 1); memoised answers are dropped."""
        self.tp = {m: t for m, t in degrees.items() if t > 1}
        everyone = {k for m in self.graph.names for k in self.sizes_of(m)}
        self.sizes = tuple(sorted(everyone))
        self._bytes.clear()
        self._transfers.clear()
        self._cache.clear()

    def tp_of(self, name: str) -> int:
        return self.tp.get(name, 1)

    def sizes_of(self, name: str) -> tuple[int, ...]:
        """Block sizes the module can take: whole replicas, a DP degree dividing the batch."""
        t = self.tp_of(name)
        return tuple(k for k in range(t, self.num_gpus + 1, t) if self.graph.global_batch % (k // t) == 0)

    def can_take(self, name: str, size: int) -> bool:
        t = self.tp_of(name)
        return size % t == 0 and self.graph.global_batch % (size // t) == 0

    def batch_of(self, name: str, size: int) -> int:
        """The module's replica batch on a `size`-GPU block (global batch / DP degree)."""
        return self.graph.global_batch // (size // self.tp_of(name))

    # --- sharded states (mosaic.sharding): one set of modules for the whole search -----------
    def set_sharded(self, modules: Collection[str]) -> None:
        """Search with these modules' states sharded wherever that saves memory (the
        planners try it when a plan does not fit: planners.shard_fallback); memoised answers
        are dropped."""
        self.sharded = frozenset(modules)
        self._bytes.clear()
        self._cache.clear()

    def shards(self, name: str, size: int) -> bool:
        """Whether the module's states are sharded on a `size`-GPU block: it is in the sharded
        set, data-parallel without TP over >= 2 GPUs, and sharding saves memory there."""
        return (name in self.sharded and self.tp_of(name) == 1 and size >= 2
                and sharding.saves_memory(self.specs[name], size))

    def shard_degree(self, name: str, size: int) -> int:
        """Placement.shard_degree of a sharded module on a `size`-GPU block: a node's GPUs
        (HSDP: its gathers stay on NVLink, only 1/k of its gradients cross the nodes) where
        the block spans whole nodes and the module still fits so, else 0 (all the block's)."""
        per_node = self.cluster.gpus_per_node
        if not self.shards(name, size) or size <= per_node or size % per_node:
            return 0
        need = replica_bytes(self.specs[name], self.graph.global_batch, size, shard=True,
                             states_over=per_node)
        return per_node if need <= self.budget_bytes else 0

    def states_over(self, name: str, size: int) -> int:
        """GPUs one copy of the module's states spreads over on a `size`-GPU block (1: whole)."""
        if not self.shards(name, size):
            return 1
        return self.shard_degree(name, size) or size

    def optimizer_params(self, name: str, size: int) -> float:
        """Parameters one GPU of a `size`-GPU block steps for the module: a TP shard's 1/t,
        a sharded module's 1/(the GPUs its states spread over)."""
        return self.specs[name].num_params / (self.tp_of(name) * self.states_over(name, size))

    # --- memoised performance-model questions ---------------------------------------------
    def _memo(self, key: tuple, compute) -> float:
        if self.use_cache and key in self._cache:
            return self._cache[key]
        self.evaluations += 1
        value = compute()
        if self.use_cache:
            self._cache[key] = value
        return value

    def per_gpu_batch(self, size: int) -> int:
        return self.graph.global_batch // size

    def module_s(self, name: str, size: int, share: float = 1.0) -> float:
        """The module alone on `share` of one GPU of a `size`-GPU block (inf: it cannot take
        that size); a TP shard's time when the module is tensor-parallel."""
        if not self.can_take(name, size):
            return INF
        spec, b, t = self.specs[name], self.batch_of(name, size), self.tp_of(name)
        if t == 1:
            return self._memo(("m", name, size, share), lambda: self.perf.module_time_s(spec, b, share))
        return self._memo(("m", name, size, share),
                          lambda: self.perf.work_time_s(Work(spec, b, share, 0, t), share))

    def allreduce_s(self, name: str, size: int, alone: bool = True) -> float:
        """Gradient all-reduce over a block placed inside as few nodes as it needs (a TP
        module's: each shard's gradients over the GPUs holding it, one per replica; a sharded
        module's all-gathers and reduce-scatter instead: PerfModel.exposed_sharded_sync_s). `alone`:
        no other module's backward runs beside this one's (a temporal block, or a block of
        one), so an engine summing during the backward hides what it can (`_exposed`)."""
        if self.shards(name, size):  # on the whole GPU: the least it can hide under
            return self._memo(("sharded", name, size), lambda: self.perf.exposed_sharded_sync_s(
                self.specs[name], self.batch_of(name, size), 1.0, tuple(range(size)),
                self.shard_degree(name, size)))
        t = self.tp_of(name)
        num_bytes = self.specs[name].num_params / t * self.perf.grad_wire_bytes
        once = self.perf.micro_step_of  # a micro-step's share of a once-a-step sync (PerfModel)
        return self._memo(("ar", name, size, alone), lambda: self._exposed(
            name, size, self.perf.allreduce_s(num_bytes, tuple(range(0, size, t))), alone) / once)

    def block_allreduce_s(self, modules: Sequence[str], size: int, sharing: str) -> float:
        """The slowest gradient sync of a block's modules, each alone in its backward only in
        a temporal block or a block of one (plan.Stage.runs_alone's rule for a block)."""
        alone = sharing == "temporal" or len(modules) == 1
        return max(self.allreduce_s(m, size, alone) for m in modules)

    def _exposed(self, name: str, size: int, total_s: float, alone: bool) -> float:
        """What the step waits for of a module's all-reduce (all of a TP module's, or of one
        whose backward runs beside another's; of a plain one's, what outlasts its backward
        where the engine sums during it), its backward on the whole GPU: the least it can
        hide under."""
        if self.tp_of(name) > 1 or not alone:
            return total_s
        return self.perf.exposed_sum_s(self.specs[name], self.batch_of(name, size), 1.0, total_s)

    def block_s(self, modules: Sequence[str], size: int, sharing: str,
                shares: Sequence[float] | None = None) -> float:
        """Compute time of a colocated group on each GPU of its block (all GPUs are alike)."""
        shares = tuple(shares) if shares is not None else (1.0,) * len(modules)
        if not all(self.can_take(m, size) for m in modules):
            return INF
        key = ("b", tuple(modules), size, sharing, shares)
        return self._memo(key, lambda: self.perf.colocated_time_s(
            self.works(modules, size, sharing, shares), sharing))

    def works(self, modules: Sequence[str], size: int, sharing: str,
              shares: Sequence[float]) -> list[Work]:
        critical = self.critical_module(modules, size, sharing)
        return [Work(self.specs[m], self.batch_of(m, size), s, int(m == critical), self.tp_of(m))
                for m, s in zip(modules, shares, strict=True)]

    def critical_module(self, modules: Sequence[str], size: int, sharing: str) -> str | None:
        """High stream priority goes to the longest module of a concurrent (free/cap) group."""
        if sharing not in ("free", "cap") or len(modules) < 2:
            return None
        return max(modules, key=lambda m: self.module_s(m, size))

    def edge_transfer_s(self, src: str, dst: str, src_size: int, dst_size: int) -> float:
        """Activations of `src` forward and their gradients back between two blocks placed
        from GPU 0 (the same set when the sizes match: nothing moves)."""
        if src_size == dst_size:
            return 0.0
        return self.placed_transfer_s(src, dst, tuple(range(src_size)), tuple(range(dst_size)))

    def placed_transfer_s(self, src: str, dst: str, src_gpus: tuple[int, ...],
                          dst_gpus: tuple[int, ...]) -> float:
        """Activations of `src` forward and gradients back between two concrete GPU sets
        (as `PerfModel.edge_transfer_s`: a TP end's every GPU gets its replica's share)."""
        num_bytes = self.specs[src].output_bytes_per_sample * self.graph.global_batch
        t_src, t_dst = self.tp_of(src), self.tp_of(dst)
        return self._memo(("xfer", src, dst, src_gpus, dst_gpus), lambda: (
            self.perf.transfer_s(num_bytes * t_dst, src_gpus, dst_gpus)
            + self.perf.transfer_s(num_bytes * t_src, src_gpus, dst_gpus)))

    def layout_penalty_s(self, modules: Sequence[str], size: int) -> float:
        """What a group's layout costs outside its stage: its estimated activation transfers."""
        return self.transfer_estimate_s(modules, size)

    def transfer_estimate_s(self, modules: Sequence[str], size: int) -> float:
        """A stage-local stand-in for the transfers a group causes: half of each edge at its
        ends, the other end assumed on the largest DP degree (where the big consumers go)."""
        return sum(self._module_transfer_s(m, size) for m in modules)

    def _module_transfer_s(self, m: str, size: int) -> float:
        key = (m, size)
        if key not in self._transfers:
            big = self.sizes[-1]
            out = sum(self.edge_transfer_s(m, s, size, big) for s in self._succ[m])
            into = sum(self.edge_transfer_s(p, m, big, size) for p in self._pred[m])
            self._transfers[key] = TRANSFER_CHARGE * (out + into)
        return self._transfers[key]

    # --- memory ------------------------------------------------------------------------------
    def module_bytes(self, name: str, size: int) -> float:
        key = (name, size)
        if key not in self._bytes:
            t = self.tp_of(name)
            batch = self.graph.global_batch // max(1, size // t)
            self._bytes[key] = tp.bytes_per_gpu(self.specs[name], batch, t)
            if self.shards(name, size):  # as plan.gpu_memory_bytes
                self._bytes[key] += sharding.added_bytes(self.specs[name], self.states_over(name, size))
        return self._bytes[key]

    def fits(self, modules: Sequence[str], size: int) -> bool:
        return (all(self.can_take(m, size) for m in modules)
                and sum(self.module_bytes(m, size) for m in modules) <= self.block_budget_bytes)

    # --- stage cost from a finished structure --------------------------------------------
    def stage_time_s(self, sharing: str, blocks: Sequence[Block]) -> float:
        compute = max(self.block_s(b.modules, b.size, sharing, b.sm_shares) for b in blocks)
        reduce = max(self.block_allreduce_s(b.modules, b.size, sharing) for b in blocks)
        return compute + reduce

    def partition_fits(self, shares: Sequence[float]) -> bool:
        """Disjoint quotas on one GPU, rounded up to the SM granularity, fit its SMs."""
        if len(shares) == 1:
            return True
        gpu = self.cluster.gpu
        return sum(gpu.round_sms(s) for s in shares) <= gpu.num_sms


def needed_tensor_parallel(space: SearchSpace) -> dict[str, int]:
    """Per module, the least TP degree (mosaic.tensor_parallel.degrees) with which it fits a
    GPU at its largest DP degree; modules that fit without TP, or fit no degree, get 1."""
    budget, batch, chosen = space.budget_bytes, space.graph.global_batch, {}
    for spec in space.graph.modules:
        for t in tp.degrees(spec, space.cluster):
            sizes = [k for k in range(t, space.num_gpus + 1, t) if batch % (k // t) == 0]
            if sizes and tp.bytes_per_gpu(spec, batch // (sizes[-1] // t), t) <= budget:
                chosen[spec.name] = t
                break
    return chosen


def faster_tensor_parallel(space: SearchSpace) -> dict[str, int]:
    """Per module, the TP degree (at least the one it has) under which it alone is fastest at
    its best fitting GPU count: the shard's compute + TP all-reduces + gradient all-reduce.
    A candidate for the search (the whole plan decides), e.g. an LLM whose global batch
    leaves data parallelism GPUs it cannot use."""
    chosen = dict(space.tp)
    for spec in space.graph.modules:
        options = [t for t in tp.degrees(spec, space.cluster) if t >= space.tp_of(spec.name)]
        if len(options) > 1:
            chosen[spec.name] = min(options, key=lambda t: _alone_best_s(space, spec, t))
    return {m: t for m, t in chosen.items() if t > 1}


def _alone_best_s(space: SearchSpace, spec: ModuleSpec, t: int) -> float:
    batch, best = space.graph.global_batch, INF
    for k in range(t, space.num_gpus + 1, t):
        if batch % (k // t) or tp.bytes_per_gpu(spec, batch // (k // t), t) > space.budget_bytes:
            continue
        work = Work(spec, batch // (k // t), 1.0, 0, t)
        reduce_s = space.perf.allreduce_s(spec.num_params / t * space.perf.grad_wire_bytes,
                                          tuple(range(0, k, t)))
        best = min(best, space.perf.work_time_s(work, 1.0) + reduce_s)
    return best


def check_modules_fit(space: SearchSpace) -> None:
    """A module whose weights, optimizer state and activations fit no GPU even at its largest
    DP degree (and TP degree) can never be placed: say which, by how much, what to change."""
    gib = 2**30
    for name in space.graph.names:
        size, t = space.sizes_of(name)[-1], space.tp_of(name)
        need = space.module_bytes(name, size)
        if need > space.budget_bytes:
            spec = space.specs[name]
            static = spec.static_bytes / t
            most = max(tp.degrees(spec, space.cluster))
            tp_note = (f" with tensor_parallel={t}" if t > 1 else
                       "" if most == 1 else f" (tensor parallelism up to {most} was tried)")
            fix = "lower global_batch, use more GPUs or a smaller module"
            if space.shards(name, size):
                static = sharding.state_bytes(spec, size, shard=True)
                tp_note += f" with its states sharded over {size} GPUs"
            elif t == 1 and need - sharding.saved_bytes(spec, size) <= space.budget_bytes:
                fix = (f"shard the states of module {name!r} over {size} GPUs (the mosaic and "
                       f"baseline planners do when nothing fits otherwise), or {fix}")
            fix = _bf16_fix(spec, need, space.budget_bytes, fix) if t == 1 else fix
            raise MemoryPlanError(
                f"module {name!r} needs {need / gib:.1f} GiB per GPU even at DP {size // t}{tp_note} "
                f"({static / gib:.1f} GiB weights + optimizer state, "
                f"{(need - static) / gib:.1f} GiB activations and bf16 weight copies) but only "
                f"{space.budget_bytes / gib:.1f} GiB is usable on {space.cluster.gpu.name}: "
                f"{(need - space.budget_bytes) / gib:.1f} GiB too much; {fix}"
            )




def _bf16_fix(spec: ModuleSpec, need: float, budget: float, fix: str) -> str:
    """`fix`, preceded by the `mosaic train` precision flags that would make the module fit
    whole (bf16 GEMM weights and moments, then no fp32 main weights too), where some do."""
    for main_weights in (True, False):
        saved, flags = tp.bf16_precision_saving(spec, main_weights=main_weights)
        if flags and need - saved <= budget:
            mains = "fp32 main weights" if main_weights else "no fp32 main weights"
            return (f"train with {flags} (bf16 GEMM weights and moments, {mains}: "
                    f"{saved / 2**30:.1f} GiB less), or {fix}")
    return fix
