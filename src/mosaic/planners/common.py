"""What every planner shares: the discrete search space and its memoised costs.

The space all planners (baselines, mosaic, exhaustive, GAHC) search is the same, so their
plans are comparable:

- a plan is a sequence of stages; the modules of a stage are mutually independent;
- a stage has one sharing mode and a set of *blocks*: a block is a run of `size` GPUs on
  which a group of modules is colocated, each module replicated on every GPU of the block
  (DP degree = size, a divisor of the global batch); blocks of a stage are disjoint;
- partition / cap shares come from a grid: multiples of the hardware's SM granularity, or
  of a coarser `sm_step`, plus 1.0 (a whole GPU / uncapped).

GPU ids are assigned at the end (`assembly`): GPUs of a node are interchangeable, so only
node boundaries (all-reduce bandwidth), activation transfers and memory balance depend on
which ids a block gets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mosaic.graph import MMGraph
from mosaic.hardware import ClusterSpec
from mosaic.perf.base import GRAD_BYTES_PER_PARAM, PerfModel, Work
from mosaic.plan import MEMORY_MARGIN, PlanError

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
                 sm_step: float | None = None, use_cache: bool = True) -> None:
        self.graph, self.cluster, self.perf = graph, cluster, perf
        self.num_gpus = cluster.num_gpus
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
        """The module alone on `share` of one GPU of a `size`-GPU block."""
        spec, b = self.specs[name], self.per_gpu_batch(size)
        return self._memo(("m", name, size, share), lambda: self.perf.module_time_s(spec, b, share))

    def allreduce_s(self, name: str, size: int) -> float:
        """Gradient all-reduce over a block placed inside as few nodes as it needs."""
        num_bytes = self.specs[name].num_params * GRAD_BYTES_PER_PARAM
        return self._memo(("ar", name, size),
                          lambda: self.perf.allreduce_s(num_bytes, tuple(range(size))))

    def block_s(self, modules: Sequence[str], size: int, sharing: str,
                shares: Sequence[float] | None = None) -> float:
        """Compute time of a colocated group on each GPU of its block (all GPUs are alike)."""
        shares = tuple(shares) if shares is not None else (1.0,) * len(modules)
        key = ("b", tuple(modules), size, sharing, shares)
        return self._memo(key, lambda: self.perf.colocated_time_s(
            self.works(modules, size, sharing, shares), sharing))

    def works(self, modules: Sequence[str], size: int, sharing: str,
              shares: Sequence[float]) -> list[Work]:
        b = self.per_gpu_batch(size)
        critical = self.critical_module(modules, size, sharing)
        return [Work(self.specs[m], b, s, int(m == critical)) for m, s in zip(modules, shares, strict=True)]

    def critical_module(self, modules: Sequence[str], size: int, sharing: str) -> str | None:
        """High stream priority goes to the longest module of a concurrent (free/cap) group."""
        if sharing not in ("free", "cap") or len(modules) < 2:
            return None
        return max(modules, key=lambda m: self.module_s(m, size))

    def edge_transfer_s(self, src: str, src_size: int, dst_size: int) -> float:
        """Activations of `src` forward and their gradients back between two blocks placed
        from GPU 0 (the same set when the sizes match: nothing moves)."""
        if src_size == dst_size:
            return 0.0
        num_bytes = self.specs[src].output_bytes_per_sample * self.graph.global_batch
        return self._memo(("tr", src, src_size, dst_size), lambda: 2 * self.perf.transfer_s(
            num_bytes, tuple(range(src_size)), tuple(range(dst_size))))

    def placed_transfer_s(self, src: str, src_gpus: tuple[int, ...], dst_gpus: tuple[int, ...]) -> float:
        """Activations of `src` forward and gradients back between two concrete GPU sets."""
        num_bytes = self.specs[src].output_bytes_per_sample * self.graph.global_batch
        return self._memo(("xfer", src, src_gpus, dst_gpus),
                          lambda: 2 * self.perf.transfer_s(num_bytes, src_gpus, dst_gpus))

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
            out = sum(self.edge_transfer_s(m, size, big) for _ in self._succ[m])
            into = sum(self.edge_transfer_s(p, big, size) for p in self._pred[m])
            self._transfers[key] = TRANSFER_CHARGE * (out + into)
        return self._transfers[key]

    # --- memory ------------------------------------------------------------------------------
    def module_bytes(self, name: str, size: int) -> float:
        key = (name, size)
        if key not in self._bytes:
            spec = self.specs[name]
            self._bytes[key] = spec.static_bytes + spec.activation_bytes_per_sample * self.per_gpu_batch(size)
        return self._bytes[key]

    def fits(self, modules: Sequence[str], size: int) -> bool:
        return sum(self.module_bytes(m, size) for m in modules) <= self.block_budget_bytes

    # --- stage cost from a finished structure --------------------------------------------
    def stage_time_s(self, sharing: str, blocks: Sequence[Block]) -> float:
        compute = max(self.block_s(b.modules, b.size, sharing, b.sm_shares) for b in blocks)
        reduce = max(self.allreduce_s(m, b.size) for b in blocks for m in b.modules)
        return compute + reduce

    def partition_fits(self, shares: Sequence[float]) -> bool:
        """Disjoint quotas on one GPU, rounded up to the SM granularity, fit its SMs."""
        if len(shares) == 1:
            return True
        gpu = self.cluster.gpu
        return sum(gpu.round_sms(s) for s in shares) <= gpu.num_sms


def check_modules_fit(space: SearchSpace) -> None:
    """A module whose weights, optimizer state and activations fit no GPU even at its largest
    DP degree can never be placed: say which, by how much, and what to change."""
    gib = 2**30
    for name in space.graph.names:
        size = space.sizes[-1]
        need = space.module_bytes(name, size)
        if need > space.budget_bytes:
            spec = space.specs[name]
            raise PlanError(
                f"module {name!r} needs {need / gib:.1f} GiB per GPU even at DP {size} "
                f"({spec.static_bytes / gib:.1f} GiB weights + optimizer state, "
                f"{(need - spec.static_bytes) / gib:.1f} GiB activations) but only "
                f"{space.budget_bytes / gib:.1f} GiB is usable on {space.cluster.gpu.name}: "
                f"{(need - space.budget_bytes) / gib:.1f} GiB too much; lower global_batch, "
                "use more GPUs or a smaller module"
            )


