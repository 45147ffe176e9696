"""Exhaustive reference search over the whole discrete space, for small graphs.

Every stage grouping (a partition of the modules into mutually independent sets that some
stage order respects) x every stage structure (partition of the stage into colocation groups
x a DP degree per group x a sharing mode) x every SM-share combination on the grid. Shares
change nothing but their own block's compute time, so each block's best combination is
found by enumerating all of them on its own; everything else is enumerated jointly and each
complete plan is costed exactly: stage times, activation transfers between the canonical GPU
ids, and memory. The only pruning is exact: a partial plan whose stage times already reach
the best complete plan cannot win (transfers and the optimizer step are never negative).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import product

from mosaic.graph import MMGraph
from mosaic.hardware import ClusterSpec
from mosaic.perf.base import PerfModel
from mosaic.plan import SHARING_MODES, Plan, PlanError
from mosaic.planners.assembly import PlanCoster, finish, fitting_plan
from mosaic.planners.common import INF, Block, SearchSpace, StageChoice, check_modules_fit
from mosaic.planners.lower import all_partitions

MAX_ORDERINGS = 600_000
"""Stage orderings walked to list the groupings (8 independent modules have 545,835)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ExhaustiveConfig:
    sm_step: float | None = None
    """Share grid, as in MosaicPlannerConfig."""
    max_plans: int = 1_000_000_000
    """Refuse spaces with more (grouping x stage structures) plans than this; the exact
    pruning visits far fewer (8 modules on 8 GPUs: ~1e8 plans, seconds)."""
    max_share_combos: int = 20_000
    """Refuse blocks whose share grid has more combinations than this."""
    time_limit_s: float | None = None
    """Give up (PlanError) after this much wall time."""


def plan_exhaustive(graph: MMGraph, cluster: ClusterSpec, perf: PerfModel,
                    config: ExhaustiveConfig | None = None) -> Plan:
    config = config or ExhaustiveConfig()
    start = time.perf_counter()
    space = SearchSpace(graph, cluster, perf, config.sm_step)
    check_modules_fit(space)
    search = _Exhaustive(space, config, start)
    groupings = search.groupings()
    search.check_size(groupings)
    best_s, best = INF, None
    for grouping in groupings:
        search.check_time()
        costed = [sorted(search.structures(x), key=lambda c: c.time_s) for x in grouping]
        found = search.best_combo(costed, best_s)
        if found is not None:
            best_s, best = found
    if best is None:  # nothing fits packed: assembly spreads it, or names the GPU and the excess
        if not search.least_overflow:
            raise PlanError(f"exhaustive: no plan of {graph.name!r} fits {cluster.num_gpus} GPUs")
        best = search.least_overflow
    meta = {"search_time_s": time.perf_counter() - start, "evaluations": space.evaluations,
            "plans": search.num_plans, "sm_step": config.sm_step}
    return finish(fitting_plan(space, best, "exhaustive", meta=meta), space)


class _Exhaustive:
    def __init__(self, space: SearchSpace, config: ExhaustiveConfig, start: float) -> None:
        self.space, self.config, self.start = space, config, start
        self.num_plans = self.visited = 0
        self.overflow, self.least_overflow = INF, []
        self.coster = PlanCoster(space)
        self._structures: dict[frozenset[str], list[StageChoice]] = {}
        self._shares: dict[tuple, tuple[float, tuple[float, ...]] | None] = {}

    # --- the space ---------------------------------------------------------------------------
    def groupings(self) -> list[tuple[frozenset[str], ...]]:
        """Each partition into stages once, in one valid stage order."""
        graph, seen, out = self.space.graph, set(), []

        def walk(done: frozenset[str], prefix: tuple[frozenset[str], ...]) -> None:
            if len(done) == len(graph.names):
                key = frozenset(prefix)
                if key not in seen:
                    seen.add(key)
                    out.append(prefix)
                return
            ready = [m for m in graph.names if m not in done and set(graph.predecessors(m)) <= done]
            for mask in range(1, 2 ** len(ready)):
                x = frozenset(m for i, m in enumerate(ready) if mask >> i & 1)
                walk(done | x, (*prefix, x))
                self.visited += 1
                if self.visited % 4096 == 0:
                    self.check_time()
                if self.visited > MAX_ORDERINGS:
                    raise PlanError(self._too_large(f"more than {MAX_ORDERINGS} stage orderings",
                                                    f"MAX_ORDERINGS={MAX_ORDERINGS}"))

        walk(frozenset(), ())
        self.visited = 0
        return out

    def _num_structures(self, x: frozenset[str]) -> int:
        counts = {}
        for r in range(1, len(x) + 1):  # size assignments of r groups within the GPUs
            counts[r] = sum(1 for ks in product(self.space.sizes, repeat=r) if sum(ks) <= self.space.num_gpus)
        return sum(counts[len(p)] * (len(SHARING_MODES) if len(p) < len(x) else 1)
                   for p in all_partitions(sorted(x)))

    def check_size(self, groupings: Sequence[tuple[frozenset[str], ...]]) -> None:
        sizes: dict[frozenset[str], int] = {}
        total = 0
        for grouping in groupings:
            total += math.prod(sizes.setdefault(x, self._num_structures(x)) for x in grouping)
            if total > self.config.max_plans:
                raise PlanError(self._too_large(f"more than {total} plans",
                                                f"max_plans={self.config.max_plans}"))
        self.num_plans = total

    def check_time(self) -> None:
        limit = self.config.time_limit_s
        if limit is not None and time.perf_counter() - self.start > limit:
            raise PlanError(f"exhaustive: {self.space.graph.name!r} on {self.space.num_gpus} GPUs did "
                            f"not finish within time_limit_s={limit}; use mosaic or gahc")

    def _too_large(self, what: str, limit: str) -> str:
        return (f"exhaustive: {self.space.graph.name!r} on {self.space.num_gpus} GPUs has {what}, "
                f"over the limit {limit}; use the mosaic or gahc planner, fewer modules/GPUs, "
                "a coarser sm_step, or raise the limit")

    def structures(self, x: frozenset[str]) -> list[StageChoice]:
        if x not in self._structures:
            self._structures[x] = list(self._enumerate(x))
        return self._structures[x]

    def _enumerate(self, x: frozenset[str]) -> Iterator[StageChoice]:
        space = self.space
        for groups in all_partitions(sorted(x)):
            self.check_time()
            for sizes in product(space.sizes, repeat=len(groups)):
                if sum(sizes) > space.num_gpus or not all(
                        space.fits(g, k) for g, k in zip(groups, sizes, strict=True)):
                    continue
                # A module alone on its GPUs runs the same in every mode: count it once.
                for mode in SHARING_MODES if len(groups) < len(x) else ("temporal",):
                    blocks = []
                    for g, k in zip(groups, sizes, strict=True):
                        found = self.best_shares(tuple(g), k, mode)
                        if found is None:
                            break
                        blocks.append(Block(tuple(g), k, found[1]))
                    else:
                        yield StageChoice(mode, tuple(blocks), space.stage_time_s(mode, blocks))

    def best_shares(self, group: tuple[str, ...], size: int, mode: str) -> tuple[float, tuple[float, ...]] | None:
        """The best share combination of one block, by enumerating every one on the grid."""
        if mode in ("temporal", "free") or len(group) == 1:
            return 0.0, (1.0,) * len(group)
        key = (group, size, mode)
        if key not in self._shares:
            combos = list(self.share_combos(len(group), mode))
            if len(combos) > self.config.max_share_combos:
                raise PlanError(
                    f"exhaustive: {len(combos)} {mode} share combinations for {list(group)} exceed "
                    f"max_share_combos={self.config.max_share_combos}; use a coarser sm_step or "
                    "raise max_share_combos")
            times = [(self.space.block_s(group, size, mode, c), c) for c in combos]
            self._shares[key] = min(times, default=None, key=lambda tc: tc[0])
        return self._shares[key]

    def share_combos(self, n: int, mode: str) -> Iterator[tuple[float, ...]]:
        """Every grid combination for n modules: caps freely, partitions within the SMs."""
        space, sms = self.space, self.space.share_sms
        if mode == "cap":
            yield from product(space.shares, repeat=n)
            return
        budget = space.cluster.gpu.num_sms

        def grow(prefix: tuple[int, ...], used: int) -> Iterator[tuple[float, ...]]:
            if len(prefix) == n:
                yield tuple(space.shares[i] for i in prefix)
                return
            for i in range(len(sms)):
                if used + sms[i] + sms[0] * (n - len(prefix) - 1) <= budget:
                    yield from grow((*prefix, i), used + sms[i])

        yield from grow((), 0)

    # --- complete plans ----------------------------------------------------------------------
    def best_combo(self, costed: Sequence[Sequence[StageChoice]], bound_s: float
                   ) -> tuple[float, list[StageChoice]] | None:
        best: list = [bound_s, None]

        def walk(i: int, partial_s: float, chosen: list[StageChoice]) -> None:
            if i == len(costed):
                total = partial_s + self.coster.transfers_s(chosen) + self.coster.optimizer_s(chosen)
                over = self.coster.overflow_bytes(chosen)
                if total < best[0] and over <= 0:
                    best[0], best[1] = total, list(chosen)
                elif over > 0 and over < self.overflow:
                    self.overflow, self.least_overflow = over, list(chosen)
                return
            self.visited += 1
            if self.visited % 4096 == 0:
                self.check_time()
            for c in costed[i]:  # sorted by stage time: the rest can only be slower
                if partial_s + c.time_s >= best[0]:
                    break
                chosen.append(c)
                walk(i + 1, partial_s + c.time_s, chosen)
                chosen.pop()

        walk(0, 0.0, [])
        return None if best[1] is None else (best[0], best[1])
