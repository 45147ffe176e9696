"""Plans that fit only with sharded states (mosaic.sharding): when a planner finds no plan that
fits memory, it plans again with the states of the module that gains most from sharding
sharded, then of the two that gain most, and so on, until a plan fits.

The mosaic planner and the baselines (megatron, distmm, spindle) all go through
`plan_sharding_if_needed`, so they search the same space: unsharded while that fits, then the
same growing sets of sharded modules (a Megatron-LM user would turn on its distributed
optimizer just the same). A plan that fits without sharding never gets it: sharding only adds
communication. Inside the search a sharded module is sharded at every DP degree where that
saves memory (`SearchSpace.shards`) and stays whole on one GPU.
"""

from __future__ import annotations

from collections.abc import Callable

from mosaic import sharding
from mosaic.plan import Plan, PlanError
from mosaic.planners.common import SearchSpace, check_modules_fit


def shard_order(space: SearchSpace) -> list[str]:
    """Modules worth sharding, most memory saved first: data-parallel without TP, and saving
    memory on their largest block (a one-layer module saves only its autocast copies at DP 2)."""
    gains = []
    for name in space.graph.names:
        size = space.sizes_of(name)[-1]
        saved = sharding.saved_bytes(space.specs[name], size)
        if space.tp_of(name) == 1 and saved > 0:
            gains.append((-saved, name))
    return [name for _, name in sorted(gains)]


def plan_sharding_if_needed(space: SearchSpace, plan_in: Callable[[SearchSpace], Plan]) -> Plan:
    """`plan_in(space)`, or, if it finds no plan that fits (PlanError), `plan_in` again with
    ever more modules' states sharded (`shard_order`). Raises the last attempt's error."""
    try:
        return plan_in(space)
    except PlanError as unsharded:
        error = unsharded
    order = shard_order(space)
    if not order:
        raise error
    space.set_sharded(order)
    check_modules_fit(space)  # a module too big even sharded: no smaller set can help
    for count in range(1, len(order) + 1):
        space.set_sharded(order[:count])
        try:
            return plan_in(space)
        except PlanError as exc:
            error = exc
    raise error
