"""GAHC reference search: a genetic algorithm with hill climbing over the planners' space.

A genome gives every module (in topological order) a stage label, a colocation-group label,
a DP-degree index and an SM-share index, and every stage label a sharing mode. Decoding
repairs it into a valid stage sequence (a consumer's label is raised above its producers',
too many groups are merged, sizes shrink until the blocks fit the GPUs, partition quotas
shrink until they fit the SMs) and costs it exactly (`PlanCoster`): stage times, transfers
between the canonical GPU ids, memory. With `use_cache`, perf-model answers and whole-plan
costs are memoised; without, every fitness evaluation asks the perf model again, which is
the uncached GAHC of the paper's search-cost comparison.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from mosaic.graph import MMGraph
from mosaic.hardware import ClusterSpec
from mosaic.perf.base import PerfModel
from mosaic.plan import SHARING_MODES, Plan, PlanError
from mosaic.planners.assembly import PlanCoster, finish, fitting_plan
from mosaic.planners.common import INF, Block, SearchSpace, StageChoice, check_modules_fit

OVER_MEMORY_S = 1e6
"""Fitness of a plan that overflows memory: this plus the overflow in GiB."""
Genome = tuple[tuple[int, ...], ...]
"""(stage, group, size index, share index) per module, then the mode index per stage label."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GAHCConfig:
    seed: int = 0
    population: int = 32
    generations: int = 150
    use_cache: bool = True
    """Memoise perf-model answers and plan costs (the 'with caching' variant)."""
    sm_step: float | None = None
    time_limit_s: float | None = None
    """Stop after this much wall time even if generations remain."""
    hill_climb_every: int = 10
    hill_climb_steps: int = 40
    elite: int = 2

    def __post_init__(self) -> None:
        if self.population < 4 or self.generations < 1:
            raise PlanError(f"population={self.population} must be >= 4 and generations >= 1")


@dataclass(frozen=True, slots=True)
class GAHCResult:
    stages: tuple[StageChoice, ...]
    cost_s: float
    evaluations: int
    """Perf-model calls (memoised ones count once with the cache, every time without)."""
    fitness_evaluations: int
    cache_hits: int
    search_time_s: float


def plan_gahc(graph: MMGraph, cluster: ClusterSpec, perf: PerfModel,
              config: GAHCConfig | None = None) -> Plan:
    config = config or GAHCConfig()
    result = run_gahc(graph, cluster, perf, config)
    space = SearchSpace(graph, cluster, perf, config.sm_step)
    meta = {"search_time_s": result.search_time_s, "evaluations": result.evaluations,
            "fitness_evaluations": result.fitness_evaluations, "cache_hits": result.cache_hits,
            "seed": config.seed, "use_cache": config.use_cache, "sm_step": config.sm_step}
    return finish(fitting_plan(space, result.stages, "gahc", meta=meta), space)


def run_gahc(graph: MMGraph, cluster: ClusterSpec, perf: PerfModel, config: GAHCConfig) -> GAHCResult:
    start = time.perf_counter()
    space = SearchSpace(graph, cluster, perf, config.sm_step, use_cache=config.use_cache)
    check_modules_fit(space)
    search = _GAHC(space, config)
    best = search.run(start)
    stages = search.decode(best)
    if stages is None:
        raise PlanError(f"gahc: found no plan of {graph.name!r} that fits {cluster.num_gpus} GPUs")
    cost_s = search.fitness(best)
    if cost_s >= OVER_MEMORY_S:  # raises, naming the GPU that overflows, unless spreading fits
        cost_s = fitting_plan(space, stages, "gahc").predicted_iteration_s
    return GAHCResult(tuple(stages), cost_s, space.evaluations, search.fitness_calls,
                      search.cache_hits, time.perf_counter() - start)


class _GAHC:
    def __init__(self, space: SearchSpace, config: GAHCConfig) -> None:
        self.space, self.config = space, config
        self.rng = random.Random(config.seed)
        self.names = space.graph.topo_order()
        self.index = {m: i for i, m in enumerate(self.names)}
        self.preds = [[self.index[p] for p in space.graph.predecessors(m)] for m in self.names]
        self.coster = PlanCoster(space)
        self.fitness_calls = self.cache_hits = 0
        self._fitness: dict[Genome, float] = {}

    # --- genomes -------------------------------------------------------------------------------
    def random_genome(self) -> Genome:
        n, r = len(self.names), self.rng.randrange
        levels = len(self.space.graph.levels())
        return (tuple(r(levels + 1) for _ in range(n)), tuple(r(3) for _ in range(n)),
                tuple(r(len(self.space.sizes)) for _ in range(n)),
                tuple(r(len(self.space.shares)) for _ in range(n)),
                tuple(r(len(SHARING_MODES)) for _ in range(n)))

    def seeded_genomes(self) -> list[Genome]:
        """Megatron (a stage per module, all GPUs) and one all-GPU temporal stage per level."""
        n, top = len(self.names), len(self.space.sizes) - 1
        level = {m: i for i, lv in enumerate(self.space.graph.levels()) for m in lv}
        same = (tuple([0] * n), tuple([top] * n), tuple([0] * n), tuple([0] * n))
        return [(tuple(range(n)), *same), (tuple(level[m] for m in self.names), *same)]

    def mutate(self, genome: Genome) -> Genome:
        """One to a few changes: a gene nudged or redrawn, or a module joining another
        module's stage and group (the structural move colocation needs)."""
        out = [list(part) for part in genome]
        limits = [len(self.names), len(self.names), len(self.space.sizes), len(self.space.shares),
                  len(SHARING_MODES)]
        changes = 1
        while self.rng.random() < 0.5 and changes < len(self.names):
            changes += 1
        for _ in range(changes):
            i = self.rng.randrange(len(self.names))
            if self.rng.random() < 0.3:
                j = self.rng.randrange(len(self.names))
                out[0][i] = out[0][j]
                out[1][i] = out[1][j] if self.rng.random() < 0.7 else self.rng.randrange(limits[1])
                out[2][i] = out[2][j]
                continue
            part = self.rng.randrange(len(out))
            limit, value = limits[part], out[part][i]
            step = self.rng.choice((-1, 1, self.rng.randrange(limit) - value))
            out[part][i] = min(limit - 1, max(0, value + step))
        return tuple(tuple(part) for part in out)

    def crossover(self, a: Genome, b: Genome) -> Genome:
        """Uniform per module: a module's genes travel together; modes per stage label."""
        pick = [self.rng.random() < 0.5 for _ in self.names]
        modules = [tuple(x if p else y for x, y, p in zip(ga, gb, pick, strict=True))
                   for ga, gb in zip(a[:4], b[:4], strict=True)]
        modes = tuple(x if self.rng.random() < 0.5 else y for x, y in zip(a[4], b[4], strict=True))
        return (*modules, modes)

    # --- decoding and fitness -------------------------------------------------------------------
    def decode(self, genome: Genome) -> list[StageChoice] | None:
        stage_gene, group_gene, size_gene, share_gene, mode_gene = genome
        labels = list(stage_gene)
        for i in range(len(self.names)):  # topological order: producers are final already
            labels[i] = max([labels[i], *(labels[p] + 1 for p in self.preds[i])])
        stages = []
        for label in sorted(set(labels)):
            members = [i for i in range(len(self.names)) if labels[i] == label]
            mode = SHARING_MODES[mode_gene[label % len(mode_gene)]]
            stage = self._stage(members, mode, group_gene, size_gene, share_gene)
            if stage is None:
                return None
            stages.append(stage)
        return stages

    def _stage(self, members: list[int], mode: str, group_gene, size_gene, share_gene) -> StageChoice | None:
        space = self.space
        by_group: dict[int, list[int]] = {}
        for i in members:
            by_group.setdefault(group_gene[i], []).append(i)
        groups = sorted(by_group.values(), key=len)
        while len(groups) > space.num_gpus:  # more groups than GPUs: merge the smallest two
            groups = sorted([groups[0] + groups[1], *groups[2:]], key=len)
        sizes = [self._fitting_size(g, size_gene[g[0]]) for g in groups]
        if None in sizes:
            return None
        while sum(space.sizes[k] for k in sizes) > space.num_gpus:
            j = max(range(len(sizes)), key=lambda j: sizes[j])
            smaller = [k for k in range(sizes[j]) if space.fits(self._names(groups[j]), space.sizes[k])]
            if not smaller:
                return None
            sizes[j] = smaller[-1]
        shares = [self._shares(g, mode, share_gene) for g in groups]
        if None in shares:  # too many quotas to fit the SMs: run this stage unquoted
            mode, shares = "free", [(1.0,) * len(g) for g in groups]
        blocks = [Block(self._names(g), space.sizes[k], sh) for g, k, sh in zip(groups, sizes, shares, strict=True)]
        return StageChoice(mode, tuple(blocks), space.stage_time_s(mode, blocks))

    def _names(self, group: list[int]) -> tuple[str, ...]:
        return tuple(self.names[i] for i in group)

    def _fitting_size(self, group: list[int], want: int) -> int | None:
        fitting = [k for k in range(len(self.space.sizes)) if self.space.fits(self._names(group), self.space.sizes[k])]
        if not fitting:
            return None
        return min(fitting, key=lambda k: (abs(k - want), -k))

    def _shares(self, group: list[int], mode: str, share_gene) -> tuple[float, ...] | None:
        space = self.space
        if mode in ("temporal", "free") or len(group) == 1:
            return (1.0,) * len(group)
        idx = [share_gene[i] for i in group]
        if mode == "partition":
            idx = [min(i, len(space.shares) - 2) for i in idx]  # 1.0 cannot share a GPU
            while not space.partition_fits([space.shares[i] for i in idx]):
                j = max(range(len(idx)), key=lambda j: idx[j])
                if idx[j] == 0:
                    return None
                idx[j] -= 1
        return tuple(space.shares[i] for i in idx)

    def fitness(self, genome: Genome) -> float:
        if self.config.use_cache and genome in self._fitness:
            self.cache_hits += 1
            return self._fitness[genome]
        self.fitness_calls += 1
        stages = self.decode(genome)
        if stages is None:
            value = INF
        else:  # a plan over memory ranks after every fitting one, closer ones first
            over = self.coster.overflow_bytes(stages)
            value = self.coster.total_s(stages) if over <= 0 else OVER_MEMORY_S + over / 2**30
        if self.config.use_cache:
            self._fitness[genome] = value
        return value

    # --- the search ----------------------------------------------------------------------------
    def run(self, start: float) -> Genome:
        """Generations of (fitness, genome): elites kept, children from tournaments,
        crossover and mutation, one random immigrant, the best hill-climbed now and then."""
        cfg = self.config
        genomes = self.seeded_genomes()
        genomes += [self.random_genome() for _ in range(cfg.population - len(genomes))]
        population = sorted(((self.fitness(g), g) for g in genomes), key=lambda p: p[0])
        for generation in range(cfg.generations):
            if cfg.time_limit_s is not None and time.perf_counter() - start > cfg.time_limit_s:
                break
            children = [self.mutate(self.crossover(self._tournament(population), self._tournament(population)))
                        for _ in range(cfg.population - cfg.elite - 1)]
            children.append(self.random_genome())
            population = population[: cfg.elite] + [(self.fitness(g), g) for g in children]
            if generation % cfg.hill_climb_every == 0:
                population[0] = self.hill_climb(*population[0])
            population.sort(key=lambda p: p[0])
        return self.hill_climb(*population[0])[1]

    def _tournament(self, population: list[tuple[float, Genome]]) -> Genome:
        return min(self.rng.sample(population, 3), key=lambda p: p[0])[1]

    def hill_climb(self, best_s: float, genome: Genome) -> tuple[float, Genome]:
        for _ in range(self.config.hill_climb_steps):
            trial = self.mutate(genome)
            if (t := self.fitness(trial)) < best_s:
                genome, best_s = trial, t
        return best_s, genome
