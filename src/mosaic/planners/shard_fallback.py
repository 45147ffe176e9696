"""Plans that fit only with sharded states (mosaic.sharding) or split modules: when a planner
finds no plan that fits memory, it plans again with the states of the module that gains most
from sharding sharded, then of the two that gain most, and so on, until a plan fits.

The mosaic planner and the baselines (megatron, distmm, spindle) all go through
`plan_fitting`, so they search the same space: unsharded while that fits, then the same growing
sets of sharded modules (a Megatron-LM user would turn on its distributed optimizer just the
same). A plan that fits without sharding never gets it: sharding only adds communication.
Inside the search a sharded module is sharded at every DP degree where that saves memory
(`SearchSpace.shards`) and stays whole on one GPU.

A module that fits no GPU whole is split by tensor parallelism (`needed_tensor_parallel`), or,
where sharding its states makes it fit, sharded instead: both add communication, TP's
all-reduces in every layer's forward and backward, FSDP's gathers and reduce-scatter beside
the compute, and which costs less depends on the batch (TP's grow with it, FSDP's do not), so
`plan_fitting` plans both ways and keeps the plan predicted faster (TP on a tie).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from mosaic import sharding
from mosaic.plan import Plan, PlanError, replica_bytes
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


def _planned(space: SearchSpace, plan_in: Callable[[SearchSpace], Plan]) -> Plan | PlanError:
    try:
        return plan_sharding_if_needed(space, plan_in)
    except PlanError as exc:
        return exc


def _step_s(space: SearchSpace, found: Plan | PlanError) -> float:
    """A way's predicted step (the whole accumulated step where the space plans one
    micro-step of it: FSDP's gathers repeat every micro-step, the TP module's gradient
    all-reduce runs once); inf where it found nothing."""
    return (space.perf.step_of_micro_s(found, space.graph) if isinstance(found, Plan)
            else float("inf"))


def _note(found: Plan | PlanError, step_s: float) -> float | str:
    """A way's predicted step in ms, or why it found nothing (meta `split_by`)."""
    return round(step_s * 1e3, 3) if isinstance(found, Plan) else str(found)


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


def plan_fitting(space: SearchSpace, plan_in: Callable[[SearchSpace], Plan]) -> Plan:
    """`plan_sharding_if_needed` with the space's TP degrees, and again with the modules that
    have TP only to fit (`splittable_by_sharding`) sharded instead; the plan predicted faster
    (meta `split_by`: each way's prediction, or why it found nothing), the space left as it
    was when that plan was found. Raises the TP way's error if neither fits."""
    instead = splittable_by_sharding(space)
    if not instead:
        return plan_sharding_if_needed(space, plan_in)
    tensor_parallel, sharded = dict(space.tp), space.sharded
    split = _planned(space, plan_in)
    split_space = (dict(space.tp), space.sharded)
    space.set_tensor_parallel({m: t for m, t in tensor_parallel.items() if m not in instead})
    space.set_sharded(sharded | set(instead))
    shard = _planned(space, plan_in)
    split_s, shard_s = _step_s(space, split), _step_s(space, shard)
    notes = {"modules": instead, "tensor_parallel": _note(split, split_s),
             "sharded": _note(shard, shard_s)}
    if shard_s < split_s:
        return replace(shard, meta={**shard.meta, "split_by": {**notes, "chose": "sharded"}})
    space.set_tensor_parallel(split_space[0])
    space.set_sharded(split_space[1])
    if isinstance(split, PlanError):
        raise split
    return replace(split, meta={**split.meta, "split_by": {**notes, "chose": "tensor_parallel"}})


def splittable_by_sharding(space: SearchSpace) -> list[str]:
    """Modules searched with TP > 1 that would fit a GPU without TP with their states sharded
    over their largest DP degree (`replica_bytes` within the usable memory)."""
    found = []
    for name, _ in sorted(space.tp.items()):
        spec = space.specs[name]
        sizes = [k for k in range(2, space.num_gpus + 1) if space.graph.global_batch % k == 0]
        if not sizes or not sharding.saves_memory(spec, sizes[-1]):
            continue
        need = replica_bytes(spec, space.graph.global_batch, sizes[-1], shard=True)
        if need <= space.budget_bytes:
            found.append(name)
    return found
