"""The lower level of the mosaic search: one stage's blocks, sharing mode and SM shares.

For a set of mutually independent modules the solver picks how they colocate (groups), the
GPUs of each group's block (its DP degree), one sharing mode for the stage and, for
partition / cap, every module's SM share on the grid, minimising the stage's predicted time
plus a stand-in for the activation transfers its layout causes.

- Groupings: all set partitions for small stages (identical modules are interchangeable, so
  partitions equal up to swapping them are tried once); for large ones, first-fit-decreasing
  packings at the smallest feasible target time of a load surrogate (SMs a module needs to
  meet the target, or its seconds for temporal sharing), at a few looser targets, plus
  all-singletons and all-together. `quick` tries only the last two (upper-level screening).
- Block sizes for a grouping: exact choice over GPU counts (`sizing.best_sizes`).
- Partition shares: water-filling (give the next SM group to the slowest module; optimal for
  a max of non-increasing times), then exact pairwise moves under the model's interference.
- Cap shares: from uncapped, lower one module's cap while the model says it helps.
- A few best layouts per stage are kept: the final choice between them is made on the exact
  cost of whole plans, where transfers between stages are known.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from mosaic.planners.common import INF, Block, SearchSpace, StageChoice
from mosaic.planners.sizing import size_groups

LOOSER_TARGETS = (1.0, 1.15, 1.35, 1.7)
"""Packings at these multiples of the smallest feasible target: more colocation each time."""
ALTERNATIVES = 4
"""Block layouts kept per stage for the exact final choice."""
THOROUGH_GROUPINGS = 3
"""Groupings of a small stage re-evaluated with refined partition shares and caps."""
MODE_ORDER = {mode: i for i, mode in enumerate(("temporal", "free", "partition", "cap"))}
"""On equal predicted time, prefer the simpler mode (uncapped caps are free sharing)."""


class StageSolver:
    def __init__(self, space: SearchSpace, exact_modules: int = 5, shares: dict | None = None) -> None:
        self.space = space
        self.exact_modules = exact_modules
        self.solves = 0
        self._ranked: dict[frozenset[str], list[StageChoice]] = {}
        self._quick: dict[frozenset[str], StageChoice | None] = {}
        self._shares: dict[tuple, tuple[float, tuple[float, ...]]] = {} if shares is None else shares
        """Best shares per (group, size, mode, thorough): pure, so solvers may share them."""
        self._rows: dict[tuple[str, int], list[float]] = {}
        self._classes = symmetry_classes(space)

    def solve(self, modules: frozenset[str]) -> StageChoice | None:
        """The cheapest stage (time + transfer estimate) for these modules, or None if they
        fit no GPUs together."""
        ranked = self.alternatives(modules)
        return ranked[0] if ranked else None

    def alternatives(self, modules: frozenset[str]) -> list[StageChoice]:
        """The cheapest stages of distinct block layouts, best first: transfers depend on
        the other stages' layouts, so the final choice among these is made exactly."""
        if modules not in self._ranked:
            self.solves += 1
            self._ranked[modules] = ranked_layouts(self._evaluated(sorted(modules)))
        return self._ranked[modules]

    def quick(self, modules: frozenset[str]) -> StageChoice | None:
        """A fast upper bound of `solve`: all modules on one block (every size and mode),
        or, if there are GPUs for it, each on its own whole GPUs."""
        if modules in self._ranked:
            return self.solve(modules)
        if modules not in self._quick:
            names = sorted(modules)
            groupings = [(tuple(names),)]
            if len(names) <= self.space.num_gpus:
                groupings.append(tuple((m,) for m in names))
            self._quick[modules] = cheapest(s for g in groupings for s in self.evaluate(g, False))
        return self._quick[modules]

    def _evaluated(self, modules: list[str]) -> list[StageChoice]:
        if len(modules) > self.exact_modules:
            return [s for g in self.packed_groupings(modules) for s in self.evaluate(g, False)]
        # Every grouping with quick shares; the best few again with refined shares and caps.
        quick = sorted((s for g in set_partitions(modules, self._classes) for s in self.evaluate(g, False)),
                       key=lambda s: s.cost_s)
        top = dict.fromkeys(tuple(b.modules for b in s.blocks) for s in quick)
        return quick + [s for g in list(top)[:THOROUGH_GROUPINGS] for s in self.evaluate(g, True)]

    def evaluate(self, groups: Sequence[tuple[str, ...]], thorough: bool) -> Iterator[StageChoice]:
        """The grouping in every sharing mode that differs (singletons: temporal only).

        Quick evaluation (large stages) water-fills partition shares and leaves caps to
        `polish`; thorough evaluation refines shares on the exact model and tries caps."""
        colocated = any(len(g) > 1 for g in groups)
        modes = ("temporal",)
        if colocated:
            modes = ("temporal", "free", "partition", "cap") if thorough else ("temporal", "free", "partition")
        for mode in modes:
            shares_for = None if mode in ("temporal", "free") else (
                lambda g, k, mode=mode: self.shares(g, k, mode, thorough))
            stage = size_groups(self.space, groups, mode, shares_for, exact=thorough)
            if stage is not None:
                yield stage

    def polish(self, stage: StageChoice) -> StageChoice:
        """The same blocks (so the same transfers) with refined partition shares or caps,
        if the model predicts either faster."""
        if not any(len(b.modules) > 1 for b in stage.blocks):
            return stage
        candidates = [stage]
        for mode in ("partition", "cap"):
            blocks = tuple(Block(b.modules, b.size, self.shares(b.modules, b.size, mode)[1]) for b in stage.blocks)
            if all(b.sm_shares for b in blocks):  # partition quotas that fit the SMs
                candidates.append(StageChoice(mode, blocks, self.space.stage_time_s(mode, blocks), stage.penalty_s))
        return cheapest(candidates)

    # --- SM shares ---------------------------------------------------------------------------
    def shares(self, group: tuple[str, ...], size: int, mode: str, thorough: bool = True
               ) -> tuple[float, tuple[float, ...]]:
        key = (group, size, mode, thorough)
        if key not in self._shares:
            if len(group) == 1:
                self._shares[key] = (self.space.block_s(group, size, mode), (1.0,))
            elif mode == "partition":
                self._shares[key] = self._partition(group, size, thorough)
            else:
                self._shares[key] = self._caps(group, size)
        return self._shares[key]

    def _partition(self, group: tuple[str, ...], size: int, thorough: bool) -> tuple[float, tuple[float, ...]]:
        space, sms = self.space, self.space.share_sms
        num_sms = space.cluster.gpu.num_sms
        idx = [0] * len(group)
        if sum(sms[0] for _ in group) > num_sms:
            return INF, ()
        times = [space.module_s(m, size, space.shares[0]) for m in group]
        used = sms[0] * len(group)
        while True:  # water-filling on the modules' own times
            slow = times.index(max(times))
            i = idx[slow]
            if i + 1 >= len(sms) or used - sms[i] + sms[i + 1] > num_sms:
                break
            idx[slow], used = i + 1, used - sms[i] + sms[i + 1]
            times[slow] = space.module_s(group[slow], size, space.shares[i + 1])
        if thorough:
            return self._refine(group, size, idx)
        shares = tuple(space.shares[i] for i in idx)
        return space.block_s(group, size, "partition", shares), shares

    def _refine(self, group: tuple[str, ...], size: int, idx: list[int]) -> tuple[float, tuple[float, ...]]:
        """Hill-climb on the exact (interference-aware) time: move one SM group between two
        modules, or add a free one, while it helps."""
        space, sms = self.space, self.space.share_sms
        num_sms = space.cluster.gpu.num_sms

        def time_of(ix: Sequence[int]) -> float:
            return space.block_s(group, size, "partition", tuple(space.shares[i] for i in ix))

        best_s = time_of(idx)
        while True:
            moves = []
            for a in range(len(group)):
                for b in [*range(len(group)), None]:
                    if a == b:
                        continue
                    ix = list(idx)
                    ix[a] += 1
                    if b is not None:
                        ix[b] -= 1
                    if ix[a] < len(sms) and min(ix) >= 0 and sum(sms[i] for i in ix) <= num_sms:
                        moves.append(ix)
            scored = [(time_of(ix), ix) for ix in moves]
            if not scored or min(scored)[0] >= best_s * (1 - 1e-9):
                return best_s, tuple(space.shares[i] for i in idx)
            best_s, idx = min(scored)

    def _caps(self, group: tuple[str, ...], size: int) -> tuple[float, tuple[float, ...]]:
        space, top = self.space, len(self.space.shares) - 1
        idx = [top] * len(group)

        def time_of(ix: Sequence[int]) -> float:
            return space.block_s(group, size, "cap", tuple(space.shares[i] for i in ix))

        best_s, improved = time_of(idx), True
        while improved:
            improved = False
            for a in range(len(group)):
                while idx[a] > 0:
                    ix = list(idx)
                    ix[a] -= 1
                    t = time_of(ix)
                    if t >= best_s * (1 - 1e-9):
                        break
                    best_s, idx, improved = t, ix, True
        return best_s, tuple(space.shares[i] for i in idx)

    # --- groupings of large stages -------------------------------------------------------------
    def packed_groupings(self, modules: list[str]) -> list[tuple[tuple[str, ...], ...]]:
        found: dict[tuple, None] = {}
        if len(modules) <= self.space.num_gpus:
            found[tuple((m,) for m in modules)] = None
        found[(tuple(modules),)] = None
        for temporal in (False, True):
            target_s = self._smallest_target(modules, temporal)
            if target_s == INF:
                continue
            for factor in LOOSER_TARGETS:
                groups = self._pack(modules, target_s * factor, temporal)
                if groups is not None:
                    found[tuple(sorted(groups))] = None
        return list(found)

    def _smallest_target(self, modules: list[str], temporal: bool) -> float:
        """Bisection (on a log scale) for the least target time a packing meets."""
        space = self.space
        lo = max(min(space.module_s(m, k) + space.allreduce_s(m, k) for k in space.sizes) for m in modules)
        hi = lo
        while self._pack(modules, hi, temporal) is None:
            hi *= 2
            if hi > lo * 2**20:
                return INF
        for _ in range(14):
            mid = (lo * hi) ** 0.5
            if self._pack(modules, mid, temporal) is None:
                lo = mid
            else:
                hi = mid
        return hi

    def _load(self, m: str, size: int, target_s: float, temporal: bool) -> float | None:
        """What `m` takes of a block: seconds (temporal) or SMs it needs to meet the target."""
        space = self.space
        budget = target_s - space.allreduce_s(m, size, alone=temporal)
        if temporal:
            t = space.module_s(m, size)
            return t if t <= budget else None
        row = self._time_row(m, size)
        i = bisect_left(row, -budget)
        return float(space.share_sms[i]) if i < len(row) else None

    def _time_row(self, m: str, size: int) -> list[float]:
        """Negated times over the share grid, made monotone, ready for bisection."""
        if (m, size) not in self._rows:
            row = [self.space.module_s(m, size, s) for s in self.space.shares]
            for i in range(len(row) - 2, -1, -1):
                row[i] = max(row[i], row[i + 1])
            self._rows[m, size] = [-t for t in row]
        return self._rows[m, size]

    def _pack(self, modules: list[str], target_s: float, temporal: bool) -> list[tuple[str, ...]] | None:
        """First-fit decreasing into blocks; None if the blocks need more GPUs than exist."""
        space = self.space
        capacity = target_s if temporal else float(space.cluster.gpu.num_sms)
        first = {}
        for m in modules:
            sizes = [k for k in space.sizes if space.fits((m,), k) and self._load(m, k, target_s, temporal) is not None]
            if not sizes:
                return None
            first[m] = (sizes[0], self._load(m, sizes[0], target_s, temporal))
        blocks: list[list] = []  # [size, members, load]
        for m in sorted(modules, key=lambda m: (-first[m][0], -first[m][1], m)):
            best = None
            for block in blocks:
                load = self._load(m, block[0], target_s, temporal)
                if load is None or block[2] + load > capacity or not space.fits([*block[1], m], block[0]):
                    continue
                if best is None or block[2] + load > best[0][2] + best[1]:
                    best = (block, load)
            if best is None:
                blocks.append([first[m][0], [m], first[m][1]])
            else:
                best[0][1].append(m)
                best[0][2] += best[1]
        if sum(b[0] for b in blocks) > space.num_gpus:
            return None
        return [tuple(sorted(b[1])) for b in blocks]


def ranked_layouts(stages: Sequence[StageChoice]) -> list[StageChoice]:
    """The cheapest stage per block layout (groups and sizes), the ALTERNATIVES best first."""
    best: dict[tuple, StageChoice] = {}
    for s in sorted(stages, key=lambda s: (s.cost_s, MODE_ORDER[s.sharing])):
        best.setdefault(tuple(sorted((b.modules, b.size) for b in s.blocks)), s)
    return list(best.values())[:ALTERNATIVES]


def cheapest(stages) -> StageChoice | None:
    """Least cost; on a tie the simpler sharing mode."""
    return min(stages, key=lambda s: (s.cost_s, MODE_ORDER[s.sharing]), default=None)


def symmetry_classes(space: SearchSpace) -> dict[str, int]:
    """Class id per module: modules with equal costs and equal neighbours are interchangeable."""
    graph, ids, out = space.graph, {}, {}
    for spec in graph.modules:
        fields = {f: getattr(spec, f) for f in spec.__slots__ if f != "name"}
        key = (tuple(sorted(fields.items())), tuple(sorted(graph.predecessors(spec.name))),
               tuple(sorted(graph.successors(spec.name))))
        out[spec.name] = ids.setdefault(key, len(ids))
    return out


def set_partitions(modules: Sequence[str], classes: dict[str, int]
                   ) -> Iterator[tuple[tuple[str, ...], ...]]:
    """Every partition of `modules` into groups, once per arrangement of interchangeable ones."""
    seen = set()
    for groups in all_partitions(list(modules)):
        signature = tuple(sorted(tuple(sorted(classes[m] for m in g)) for g in groups))
        if signature not in seen:
            seen.add(signature)
            yield tuple(tuple(g) for g in groups)


def all_partitions(items: list[str]) -> Iterator[list[list[str]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in all_partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1:]]
