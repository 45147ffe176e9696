"""GPU counts for fixed colocation groups: exact, by knapsacks over GPU counts (numpy).

A stage costs  max_j compute_j + max_j allreduce_j + sum_j penalty_j  over its groups j
(penalty: the transfers its layout causes, `SearchSpace.layout_penalty_s`),
each group choosing one size (DP degree), the sizes summing to at most the GPUs. For a bound
T on compute and R on all-reduce the rest is a multiple-choice knapsack: the least total
penalty with every group within both bounds and the GPUs, solved for all T at once by a DP
over groups on a (T, GPUs used) array.

Fast path: fold the two maxima into one bound (compute_j + allreduce_j <= T). The folded cost
never exceeds the true one, so its optimum is a lower bound; the folded choice, polished by
one-group changes, is an upper bound. When they meet (usually) that is the optimum; otherwise
every all-reduce bound R that can still win is solved exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from mosaic.planners.common import INF, Block, SearchSpace, StageChoice

Option = tuple[int, float, float, float]
"""(size, compute_s, allreduce_s, penalty_s) of one group at one DP degree."""


def stage_cost_s(options: Sequence[Sequence[Option]], picks: Sequence[int]) -> float:
    chosen = [opts[i] for opts, i in zip(options, picks, strict=True)]
    return max(o[1] for o in chosen) + max(o[2] for o in chosen) + sum(o[3] for o in chosen)


def best_sizes(options: Sequence[Sequence[Option]], num_gpus: int, exact: bool = True
               ) -> tuple[float, tuple[int, ...]]:
    """Option index per group minimising the stage cost; (inf, ()) if no choice fits.

    `exact=False` stops after the fast path (folded knapsack + polish): an upper bound."""
    if not options or not all(options):
        return INF, ()
    if len(options) == 1:  # one group: its cheapest size
        i = min(range(len(options[0])), key=lambda i: stage_cost_s(options, [i]))
        return stage_cost_s(options, [i]), (i,)
    lower, picks = _knapsack(options, num_gpus, None)
    if picks is None:
        return INF, ()
    best = _polish(options, num_gpus, picks)
    if not exact or best[0] <= lower * (1 + 1e-9):
        return best
    for bound in sorted({o[2] for opts in options for o in opts}):
        if bound >= best[0]:
            break
        allowed = [[o for o in opts if o[2] <= bound] for opts in options]
        if not all(allowed):
            continue
        floor = max(min(o[1] for o in al) for al in allowed) + sum(min(o[3] for o in al) for al in allowed)
        if bound + floor >= best[0] * (1 - 1e-12):
            continue
        cost, picks = _knapsack(options, num_gpus, bound, best[0] - bound - floor + max(
            min(o[1] for o in al) for al in allowed))
        if picks is not None and cost < best[0]:
            best = (stage_cost_s(options, picks), tuple(picks))
    return best


def _knapsack(options: Sequence[Sequence[Option]], num_gpus: int, reduce_bound: float | None,
              max_target: float = INF) -> tuple[float, list[int] | None]:
    """Least (T [+ R] + total penalty) over every target T with all groups within the GPUs.

    reduce_bound None: T bounds compute + all-reduce (the fold, a lower bound of the cost).
    Else: only options with all-reduce <= R, T bounds compute, and R is added (exact for R).
    Targets above `max_target` cannot win and are skipped.
    """
    def need(o: Option) -> float:
        return o[1] + o[2] if reduce_bound is None else (o[1] if o[2] <= reduce_bound else INF)

    floor = max(min(need(o) for o in opts) for opts in options)
    if floor == INF:
        return INF, None
    targets = np.array(sorted({need(o) for opts in options for o in opts if floor <= need(o) < max_target}))
    if not len(targets):
        return INF, None
    # GPUs beyond what the largest options together use change nothing: on a large cluster
    # (many identical GPUs) this keeps the DP as narrow as the groups' own sizes.
    width = min(num_gpus, sum(max(o[0] for o in opts) for opts in options)) + 1
    dp = np.full((len(targets), width), INF)
    dp[:, 0] = 0.0
    choices = []
    for opts in options:
        # One shifted slice per option, kept where strictly better: the first of equal options
        # wins, as an argmin would, without a (targets x options x GPUs) gather (which
        # dominated planning at 1024 GPUs).
        best = np.full_like(dp, INF)
        arg = np.zeros(dp.shape, dtype=np.int64)
        for i, o in enumerate(opts):
            size, rows = o[0], targets >= need(o)
            if size >= width or not rows.any():
                continue
            cand = np.full_like(dp, INF)
            cand[rows, size:] = dp[rows, :width - size] + o[3]
            better = cand < best
            best[better], arg[better] = cand[better], i
        dp = best
        choices.append(arg)
    total = targets[:, None] + dp + (reduce_bound or 0.0)
    flat = int(np.argmin(total))
    if not np.isfinite(total.flat[flat]):
        return INF, None
    t, gpus = np.unravel_index(flat, total.shape)
    picks = []
    for opts, arg in zip(reversed(options), reversed(choices), strict=True):
        i = int(arg[t, gpus])
        picks.append(i)
        gpus -= opts[i][0]
    return float(total.flat[flat]), picks[::-1]


def _polish(options: Sequence[Sequence[Option]], num_gpus: int, picks: list[int]
            ) -> tuple[float, tuple[int, ...]]:
    """Exact cost; then change one group's size at a time while it helps (first fit)."""
    best_s = stage_cost_s(options, picks)
    improved = True
    while improved:
        improved = False
        used = sum(opts[i][0] for opts, i in zip(options, picks, strict=True))
        for j, opts in enumerate(options):
            for i, opt in enumerate(opts):
                if i == picks[j] or used - opts[picks[j]][0] + opt[0] > num_gpus:
                    continue
                trial = [*picks[:j], i, *picks[j + 1:]]
                t = stage_cost_s(options, trial)
                if t < best_s * (1 - 1e-12):
                    best_s, picks, improved = t, trial, True
                    used = sum(o[p][0] for o, p in zip(options, picks, strict=True))
    return best_s, tuple(picks)


SharesFor = Callable[[tuple[str, ...], int], tuple[float, tuple[float, ...]]]


def size_groups(space: SearchSpace, groups: Sequence[tuple[str, ...]], sharing: str,
                shares_for: SharesFor | None = None, exact: bool = True) -> StageChoice | None:
    """Blocks for fixed colocation groups, sized by `best_sizes`.

    `shares_for(group, size) -> (compute_s, shares)` supplies quota-optimised times for
    partition / cap; without it every share is 1.0. None if the groups cannot fit.
    """
    options: list[list[Option]] = []
    shares: list[list[tuple[float, ...]]] = []
    for group in groups:
        opts, sh = [], []
        for k in space.sizes:
            if not space.fits(group, k):
                continue
            if shares_for is None:
                t, quota = space.block_s(group, k, sharing), (1.0,) * len(group)
            else:
                t, quota = shares_for(group, k)
            if t < INF:
                reduce = space.block_allreduce_s(group, k, sharing)
                opts.append((k, t, reduce, space.layout_penalty_s(group, k)))
                sh.append(quota)
        options.append(opts)
        shares.append(sh)
    cost_s, picks = best_sizes(options, space.num_gpus, exact)
    if cost_s == INF:
        return None
    blocks = tuple(Block(g, options[j][i][0], shares[j][i]) for j, (g, i) in enumerate(zip(groups, picks, strict=True)))
    penalty = sum(options[j][i][3] for j, i in enumerate(picks))
    return StageChoice(sharing, blocks, cost_s - penalty, penalty)


def stage_of_singletons(space: SearchSpace, modules: Sequence[str], sharing: str,
                        sizes: Sequence[int]) -> StageChoice:
    blocks = tuple(Block((m,), k, (1.0,)) for m, k in zip(modules, sizes, strict=True))
    penalty = sum(space.layout_penalty_s((m,), k) for m, k in zip(modules, sizes, strict=True))
    return StageChoice(sharing, blocks, space.stage_time_s(sharing, blocks), penalty)
