"""The mosaic planner: a two-level search over stage groupings and per-stage placements.

Upper level: which mutually independent modules share a stage. Iteration time is the sum of
stage times, so the best sequence of stages is a shortest path over the DAG's down-sets
(modules already run): from a down-set, any non-empty set of ready modules may form the
next stage. The exact DP over down-sets enumerates ready sets up to symmetry (interchangeable
modules are counted, not named) when it has at most `exact_transitions` transitions. Larger
graphs start from the DAG's ASAP and ALAP layerings and descend by best improvement (move a
module to another stage or a new one, merge neighbouring stages, or move several modules
between the same two stages at once): first on quick stage costs (one block per stage, or
whole GPUs per module), then on full stage solves of the few best-screened neighbours.

Lower level (`lower.StageSolver`): groups, GPU counts, sharing mode and SM shares of one
stage; every answer is memoised by module set, every perf-model answer by its arguments.
Each stage keeps a few alternative layouts; the combination is chosen on the exact cost of
the whole plan (activation transfers between stages depend on both ends).

The baselines' plans are candidates too, so the result is never predicted slower than any
of them; the chosen plan always fits memory, or PlanError says what does not.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import product

from mosaic.graph import MMGraph
from mosaic.hardware import ClusterSpec
from mosaic.perf.base import PerfModel
from mosaic.plan import Plan, PlanError, run_key
from mosaic.planners.assembly import PlanCoster, finish, fitting_plan
from mosaic.planners.common import (
    INF,
    SearchSpace,
    StageChoice,
    check_modules_fit,
    faster_tensor_parallel,
)
from mosaic.planners.distmm import distmm_stages
from mosaic.planners.lower import StageSolver, symmetry_classes
from mosaic.planners.megatron import megatron_stages
from mosaic.planners.shard_fallback import plan_fitting
from mosaic.planners.spindle import spindle_stages


@dataclass(frozen=True, kw_only=True, slots=True)
class MosaicPlannerConfig:
    sm_step: float | None = None
    """Grid of partition / cap shares: None = the hardware's SM granularity (8 SMs on
    Hopper), else multiples of this fraction (0.1, 0.2, 0.3: coarser, faster, worse)."""
    time_limit_s: float = 10.0
    """Wall-clock cap on the upper-level local search (the search normally ends far sooner)."""
    exact_stage_modules: int = 5
    """Stages of at most this many modules try every colocation grouping."""
    exact_transitions: int = 400
    """Use the exact DP over stage groupings when it has at most this many transitions."""
    screened: int = 6
    """Local search on full stage solves: neighbours per step solved, best quick costs first."""
    restarts: int = 4
    """Extra local-search starts from seeded random groupings, each made only while the
    search has asked the perf model fewer than `restart_evaluations` questions."""
    restart_evaluations: int = 3000
    """Evaluation budget for restarts: graphs up to ~12 modules get them, large ones stay fast."""
    min_gain: float = 0.01
    """A colocating plan must be predicted this fraction faster than the best baseline, or the
    baseline is returned: on the H200 a 0.5% predicted gain measured 1.5% slower (qwen3-vl),
    inside the model's held-out error. Never slower than a baseline beats a sliver faster."""
    tensor_parallel: str = "needed"
    """'needed': tensor parallelism only for a module that fits no GPU without it (as every
    planner); 'faster': also search with each TP-able module at the degree under which it alone
    is fastest, keeping the faster plan (planner `mosaic-tp`). Not the default: the engine
    compiles TP modules but does not capture them as CUDA graphs (their collectives), which
    the TP cost model does not price, and TP is not measured on a GPU yet."""

    def __post_init__(self) -> None:
        if self.tensor_parallel not in ("needed", "faster"):
            raise PlanError(f"tensor_parallel={self.tensor_parallel!r}: use 'needed' or 'faster'")
        if self.sm_step is not None and not 0 < self.sm_step <= 1:
            raise PlanError(f"sm_step={self.sm_step} must be in (0, 1] (or None for the hardware grid)")
        if not 0 <= self.min_gain < 1:
            raise PlanError(f"min_gain={self.min_gain} must be in [0, 1)")
        if self.time_limit_s <= 0:
            raise PlanError(f"time_limit_s={self.time_limit_s} must be > 0")
        if self.exact_stage_modules < 1 or min(self.exact_transitions, self.restarts) < 0 or self.screened < 1:
            raise PlanError("exact_stage_modules and screened must be >= 1, exact_transitions and "
                            "restarts >= 0")


Grouping = tuple[frozenset[str], ...]
EXACT_COMBINATIONS = 64
"""Stage-layout combinations of a found grouping costed exactly at the end."""



def plan_mosaic(graph: MMGraph, cluster: ClusterSpec, perf: PerfModel,
                config: MosaicPlannerConfig | None = None) -> Plan:
    """The fastest plan the search predicts (meta: search_time_s, evaluations, the winner);
    with some modules' states sharded when nothing fits without (planners.shard_fallback)."""
    config = config or MosaicPlannerConfig()
    start = time.perf_counter()
    space = SearchSpace(graph, cluster, perf, config.sm_step)
    chosen = plan_fitting(space, lambda s: search_plan(s, config, start))
    if config.tensor_parallel == "faster":
        chosen = with_faster_tensor_parallel(space, chosen, lambda s: search_plan(s, config, start))
    chosen = with_micro_batch_overlap(chosen, graph, cluster, perf, config.min_gain)
    return never_slower_than_baselines(chosen, graph, cluster, perf, config.min_gain)


def search_plan(space: SearchSpace, config: MosaicPlannerConfig, start: float) -> Plan:
    """The two-level search in one space: its fastest candidate that fits, validated."""
    check_modules_fit(space)
    coster = PlanCoster(space)
    solver = StageSolver(space, config.exact_stage_modules)
    upper = UpperSearch(space, solver, config, time.perf_counter() + config.time_limit_s)
    groupings = upper.candidates()
    candidates = {f"mosaic-{upper.method}-{i}": best_layouts(solver, coster, g)
                  for i, g in enumerate(groupings)}
    candidates.update(baseline_candidates(space))
    errors: list[str] = []
    plan, name = first_fitting(space, coster, candidates, errors, config.min_gain)
    if plan is None:  # memory binds across stages: give each stage its own share of it
        layered = [upper.layering(asap=True), upper.layering(asap=False)]
        capped = memory_capped(space, solver, config, [*groupings, *layered])
        plan, name = first_fitting(space, coster, capped, errors, config.min_gain)
    if plan is None:
        raise PlanError(errors[0])
    meta = {"search_time_s": time.perf_counter() - start, "evaluations": space.evaluations,
            "stage_solves": solver.solves, "upper_level": upper.method, "chosen_from": name,
            "sm_step": config.sm_step, "min_gain": config.min_gain}
    return finish(Plan(model=plan.model, planner="mosaic", num_gpus=plan.num_gpus,
                       stages=plan.stages, perf_model=plan.perf_model, meta=meta), space)


def plan_mosaic_alternatives(graph: MMGraph, cluster: ClusterSpec, perf: PerfModel, count: int,
                             config: MosaicPlannerConfig | None = None) -> list[Plan]:
    """The search's `count` best plans that run differently (`run_key`), best predicted
    first: the stage groupings it ended on and those one move from its best, each with its
    stages' layouts in every sharing mode combined (`best_layouts` keeps one combination;
    this keeps the next ones too). For measured selection (autotune): plans the model
    predicts within its error of the best are worth a measurement. Empty where nothing fits
    without sharding (the planner's own plan handles that)."""
    config = config or MosaicPlannerConfig()
    space = SearchSpace(graph, cluster, perf, config.sm_step)
    try:
        check_modules_fit(space)
    except PlanError:
        return []
    coster = PlanCoster(space)
    solver = StageSolver(space, config.exact_stage_modules)
    upper = UpperSearch(space, solver, config, time.perf_counter() + config.time_limit_s)
    found = upper.candidates()
    # The groupings one step from the best (a module moved, split off or two stages merged):
    # where the model's error is a few percent, the runner-up grouping is worth measuring.
    nearby = sorted(dict.fromkeys(g for g, _ in upper.neighbours(found[0])), key=upper.total)
    ranked = sorted((combo for g in dict.fromkeys([*found, *nearby[:count]])
                     for combo in ranked_layouts(solver, coster, g, count)),
                    key=lambda combo: coster.total_s(combo))
    plans: dict[tuple, Plan] = {}
    for combo in ranked:
        try:
            plan = finish(fitting_plan(space, combo, "mosaic"), space)
        except PlanError:
            continue
        plans.setdefault(run_key(plan), plan)
        if len(plans) == count:
            break
    ordered = sorted(plans.values(), key=lambda p: p.predicted_iteration_s)
    return [replace(p, meta={**p.meta, "alternative": i}) for i, p in enumerate(ordered, 1)]


def ranked_layouts(solver: StageSolver, coster: PlanCoster, grouping: Grouping,
                   count: int) -> list[tuple[StageChoice, ...]]:
    """The `count` cheapest combinations (exact cost) of each stage's variants: its best block
    layouts, each in every sharing mode with the shares the solver finds for it."""
    options = [solver.alternatives(x) for x in grouping]
    if not all(options):
        return []
    per_stage = max(1, int(EXACT_COMBINATIONS ** (1 / len(grouping))))
    variants = [stage_variants(solver, o[:per_stage])[:per_stage] for o in options]
    return sorted(product(*variants), key=lambda c: coster.total_s(c))[:count]


def stage_variants(solver: StageSolver, layouts: Sequence[StageChoice]) -> list[StageChoice]:
    """Each layout polished, as found, and in every sharing mode (`StageSolver.evaluate`,
    thorough), distinct, cheapest first."""
    out: dict[tuple, StageChoice] = {}
    for stage in layouts:
        groups = tuple(b.modules for b in stage.blocks)
        for variant in (solver.polish(stage), stage, *solver.evaluate(groups, True)):
            out.setdefault((variant.sharing, variant.blocks), variant)
    return sorted(out.values(), key=lambda v: v.cost_s)


def with_faster_tensor_parallel(space: SearchSpace, chosen: Plan,
                                plan_in: Callable[[SearchSpace], Plan]) -> Plan:
    """Search once more with the TP degrees under which TP-able modules alone are fastest
    (`faster_tensor_parallel`), when they differ from the ones searched; keep the faster plan
    (MosaicPlannerConfig.tensor_parallel='faster')."""
    faster = faster_tensor_parallel(space)
    if faster == space.tp:
        return chosen
    space.set_tensor_parallel(faster)
    try:
        alternative = plan_in(space)
    except PlanError:
        return chosen
    if alternative.predicted_iteration_s < chosen.predicted_iteration_s:
        return alternative
    return chosen


def with_micro_batch_overlap(plan: Plan, graph: MMGraph, cluster: ClusterSpec, perf: PerfModel,
                             min_gain: float) -> Plan:
    """On one GPU, try two micro-batches (the LLM beside the next micro-batch's encoders);
    keep them only if predicted faster by min_gain. Contrastive heads (kind 'head') need the
    whole batch, so only LLM sinks qualify."""
    eligible = (cluster.num_gpus == 1 and len(plan.stages) > 1 and graph.global_batch % 2 == 0
                and all(graph.module(s).kind == "llm" for s in graph.sinks))
    if not eligible:
        return plan
    overlapped = perf.predict(replace(plan, micro_batches=2).validate(graph, cluster), graph)
    if overlapped.predicted_iteration_s < plan.predicted_iteration_s * (1 - min_gain):
        return overlapped
    return plan


def never_slower_than_baselines(chosen: Plan, graph: MMGraph, cluster: ClusterSpec,
                                perf: PerfModel, min_gain: float) -> Plan:
    """The last word: the baseline planners' own plans, predicted by the same model on their
    real GPU ids, replace the choice unless it beats them (by min_gain when it colocates)."""
    from mosaic.planners.distmm import plan_distmm
    from mosaic.planners.megatron import plan_megatron
    from mosaic.planners.spindle import plan_spindle

    baselines = []
    for planner in (plan_megatron, plan_distmm, plan_spindle):
        try:
            baselines.append(planner(graph, cluster, perf))
        except PlanError:
            continue
    colocates = any(len(s.on_gpu(g)) > 1 for s in chosen.stages for g in range(chosen.num_gpus))
    need = 1.0 - min_gain if colocates else 1.0
    best = min(baselines, key=lambda b: b.predicted_iteration_s, default=None)
    if best is None or chosen.predicted_iteration_s <= best.predicted_iteration_s * need:
        return chosen
    meta = {**chosen.meta, "chosen_from": f"{best.planner} (baseline plan)"}
    return Plan(model=best.model, planner="mosaic", num_gpus=best.num_gpus, stages=best.stages,
                predicted_iteration_s=best.predicted_iteration_s, perf_model=best.perf_model,
                meta=meta)


def memory_capped(space: SearchSpace, solver: StageSolver, config: MosaicPlannerConfig,
                  groupings: list[Grouping]) -> dict[str, list[StageChoice]]:
    """Stages re-solved under per-GPU byte caps that sum to the usable memory, so any
    placement fits. A stage's cap is its floor (its largest module at the largest DP degree,
    which it needs somewhere) plus a share of the slack in proportion to what it would need
    beyond that with all its modules on every GPU."""
    out, biggest = {}, space.sizes[-1]
    for i, grouping in enumerate(dict.fromkeys(groupings)):
        floors = [max(space.module_bytes(m, biggest) for m in x) for x in grouping]
        extras = [sum(space.module_bytes(m, biggest) for m in x) - f for x, f in zip(grouping, floors, strict=True)]
        slack = space.budget_bytes - sum(floors)
        if slack < 0:
            continue
        stages = []
        for x, floor, extra in zip(grouping, floors, extras, strict=True):
            space.block_budget_bytes = floor + slack * extra / max(sum(extras), 1.0)
            stage = StageSolver(space, config.exact_stage_modules, solver._shares).solve(x)
            if stage is None:
                break
            stages.append(stage)
        else:
            out[f"mosaic-memory-capped-{i}"] = stages
        space.block_budget_bytes = space.budget_bytes
    return out


def baseline_candidates(space: SearchSpace) -> dict[str, list[StageChoice]]:
    out = {}
    for name, stages in (("megatron", megatron_stages), ("distmm", distmm_stages),
                         ("spindle", spindle_stages)):
        try:
            out[name] = stages(space)
        except PlanError:
            continue
    return out


def _margin(name: str, min_gain: float) -> float:
    return 1.0 / (1.0 - min_gain) if name.startswith("mosaic") else 1.0


def first_fitting(space: SearchSpace, coster: PlanCoster, candidates: dict[str, list[StageChoice]],
                  errors: list[str], min_gain: float = 0.0) -> tuple[Plan | None, str]:
    """The candidate of least exact cost that assembles within memory; a colocating candidate
    must beat the baselines by `min_gain` (mosaic's on ties)."""
    ranked = sorted(candidates, key=lambda n: (coster.total_s(candidates[n]) * _margin(n, min_gain),
                                              not n.startswith("mosaic")))
    for name in ranked:  # the exact cost assumed packed GPU ids; assembly may still spread memory
        try:
            return fitting_plan(space, candidates[name], "mosaic"), name
        except PlanError as exc:
            errors.append(str(exc))
    return None, ""


def best_layouts(solver: StageSolver, coster: PlanCoster, grouping: Grouping) -> list[StageChoice]:
    """Each stage's layout from its few best alternatives, the combination chosen on exact
    cost (transfers between stages included), then shares polished."""
    options = [solver.alternatives(x) for x in grouping]
    per_stage = max(1, int(EXACT_COMBINATIONS ** (1 / len(grouping))))
    combos = product(*(o[:per_stage] for o in options))
    best = min(combos, key=lambda c: coster.total_s(c))
    return [solver.polish(s) for s in best]


class UpperSearch:
    """Which modules form each stage; cost of a grouping = sum of its stages' solved times."""

    def __init__(self, space: SearchSpace, solver: StageSolver, config: MosaicPlannerConfig,
                 deadline: float) -> None:
        self.space, self.solver, self.config, self.deadline = space, solver, config, deadline
        graph = space.graph
        self.names = graph.topo_order()
        self.preds = {m: frozenset(graph.predecessors(m)) for m in self.names}
        self.classes = symmetry_classes(space)
        self.method = ""

    def cost(self, modules: frozenset[str], quick: bool = False) -> float:
        stage = self.solver.quick(modules) if quick else self.solver.solve(modules)
        return INF if stage is None else stage.cost_s

    def candidates(self) -> list[Grouping]:
        """The best grouping(s) found, best first; exact costing picks among them."""
        if self._count_transitions(frozenset(), {}, self.config.exact_transitions) is not None:
            self.method = "exact-dp"
            return [self._dp(frozenset(), {})[1]]
        # Large graphs: local search on quick stage costs (one block per stage, or whole GPUs
        # per module), then on full stage solves from the best of those.
        self.method = "local-search"
        starts = [self.layering(asap=True), self.layering(asap=False)]
        found = [self.improve(g, quick=True) for g in dict.fromkeys(starts)]
        rng = random.Random(0)
        for _ in range(self.config.restarts):  # small graphs: cheap, and they escape local optima
            if self.space.evaluations >= self.config.restart_evaluations:
                break
            found.append(self.improve(self.random_grouping(rng), quick=True))
        found.append(self.improve(min(found, key=self.total), quick=False))
        return sorted(dict.fromkeys(found), key=self.total)

    # --- exact DP over down-sets -----------------------------------------------------------
    def ready_classes(self, done: frozenset[str]) -> list[list[str]]:
        """Ready modules, grouped by interchangeable class."""
        by_class: dict[int, list[str]] = {}
        for m in self.names:
            if m not in done and self.preds[m] <= done:
                by_class.setdefault(self.classes[m], []).append(m)
        return list(by_class.values())

    def ready_sets(self, done: frozenset[str]) -> list[frozenset[str]]:
        """Non-empty sets of ready modules, one per count of each interchangeable class."""
        members = self.ready_classes(done)
        out = []
        for counts in product(*(range(len(c) + 1) for c in members)):
            if any(counts):
                out.append(frozenset(m for c, n in zip(members, counts, strict=True) for m in c[:n]))
        return out

    def _count_transitions(self, done: frozenset[str], memo: dict, budget: int) -> int | None:
        """Transitions of the DP, or None as soon as they exceed the budget."""
        if done in memo:
            return 0
        memo[done] = True
        if math.prod(len(c) + 1 for c in self.ready_classes(done)) - 1 > budget:
            return None
        total = 0
        for x in self.ready_sets(done):
            total += 1
            sub = self._count_transitions(done | x, memo, budget - total)
            if sub is None or total + sub > budget:
                return None
            total += sub
        return total

    def _dp(self, done: frozenset[str], memo: dict) -> tuple[float, Grouping]:
        if len(done) == len(self.names):
            return 0.0, ()
        if done not in memo:
            best: tuple[float, Grouping] = (INF, ())
            for x in self.ready_sets(done):
                head = self.cost(x)
                if head >= best[0]:
                    continue
                rest, tail = self._dp(done | x, memo)
                if head + rest < best[0]:
                    best = (head + rest, (x, *tail))
            memo[done] = best
        return memo[done]

    # --- local search for large graphs -------------------------------------------------------
    def layering(self, asap: bool) -> Grouping:
        levels = self.space.graph.levels()
        if asap:
            return tuple(frozenset(level) for level in levels)
        graph = self.space.graph
        latest: dict[str, int] = {}
        for m in reversed(self.names):
            latest[m] = min((latest[s] - 1 for s in graph.successors(m)), default=len(levels) - 1)
        return tuple(frozenset(m for m in self.names if latest[m] == i) for i in range(len(levels)))

    def random_grouping(self, rng: random.Random) -> Grouping:
        """Random stage labels, each raised above its producers' (a valid grouping)."""
        label: dict[str, int] = {}
        depth = len(self.space.graph.levels())
        for m in self.names:
            label[m] = max([rng.randrange(depth + 1), *(label[p] + 1 for p in self.preds[m])])
        return tuple(frozenset(m for m in self.names if label[m] == v) for v in sorted(set(label.values())))

    def total(self, grouping: Grouping, quick: bool = False) -> float:
        return sum(self.cost(x, quick) for x in grouping)

    def valid(self, grouping: Sequence[frozenset[str]]) -> bool:
        index = {m: i for i, x in enumerate(grouping) for m in x}
        return all(index[p] < index[m] for m in self.names for p in self.preds[m])

    def neighbours(self, grouping: Grouping) -> list[tuple[Grouping, tuple]]:
        """Valid groupings one step away, each with its step: move one module to another
        stage, split it off into a new stage just before or after its own, merge neighbours."""
        out = []
        for i, x in enumerate(grouping):
            for m in sorted(x):
                for j in range(len(grouping)):
                    if j != i:
                        out.append((self.moved(grouping, [m], i, j), ("move", i, j, m)))
                if len(x) > 1:
                    for pos in (i, i + 1):
                        g = [*grouping]
                        g[i] = x - {m}
                        g.insert(pos, frozenset({m}))
                        out.append((tuple(g), ("split",)))
        for i in range(len(grouping) - 1):
            out.append(((*grouping[:i], grouping[i] | grouping[i + 1], *grouping[i + 2:]), ("merge",)))
        return [(g, step) for g, step in out if self.valid(g)]

    @staticmethod
    def moved(grouping: Grouping, modules: Sequence[str], i: int, j: int) -> Grouping:
        g = [*grouping]
        g[i], g[j] = grouping[i] - set(modules), grouping[j] | set(modules)
        return tuple(s for s in g if s)

    def compound(self, grouping: Grouping, scored: list) -> list[Grouping]:
        """Several improving moves between the same two stages at once (the best 2, 4, 8 ...),
        so a descent that would move modules one by one takes one step."""
        by_pair: dict[tuple[int, int], list[str]] = {}
        for _, _, _, step in scored:  # sorted best first
            if step[0] == "move":
                by_pair.setdefault(step[1:3], []).append(step[3])
        out = []
        for (i, j), modules in by_pair.items():
            k = 2
            while k <= len(modules):
                g = self.moved(grouping, modules[:k], i, j)
                if self.valid(g):
                    out.append(g)
                k *= 2
        return out

    def improve(self, grouping: Grouping, quick: bool) -> Grouping:
        """Best-improvement descent over `neighbours` (plus compound moves) until none helps
        or time runs out. On full stage solves only the `screened` neighbours with the best
        quick costs are solved."""
        best_s = self.total(grouping, quick)
        while time.perf_counter() < self.deadline:
            scored = [(self.total(g, quick=True), len(g), g, step) for g, step in self.neighbours(grouping)]
            scored.sort(key=lambda s: (s[0], s[1]))
            now_s = self.total(grouping, quick=True)
            better = [s for s in scored if s[0] < now_s * (1 - 1e-9)]
            scored += [(self.total(g, quick=True), len(g), g, ("compound",))
                       for g in self.compound(grouping, better)]
            scored.sort(key=lambda s: (s[0], s[1]))
            if not quick:
                scored = sorted(((self.total(g), n, g, step) for _, n, g, step in scored[: self.config.screened]),
                                key=lambda s: (s[0], s[1]))
            if not scored or scored[0][0] >= best_s * (1 - 1e-9):
                break
            best_s, grouping = scored[0][0], scored[0][2]
        return grouping
