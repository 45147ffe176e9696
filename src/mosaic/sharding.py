"""Sharded training states (FSDP2, ZeRO-3 style): the cost facts the plan, the performance
model and the planners share.

A placement with `shard = True` keeps 1/d of its module's weights, gradients and optimizer
state on each of its d GPUs (torch's `fully_shard`, see `mosaic.engine.fsdp`) instead of a
full copy on each; with `shard_degree` k (HSDP) d is k, each run of k GPUs holding a copy
(`Placement.states_over`: the d the functions below take). The engine shards each layer of the module (the elements of its
`nn.ModuleList`s) as one unit and the module's remaining parameters (embeddings, norms,
heads) as one more, so only a few units are ever whole at once.

What the cost model assumes (counts, not measurements), for the engine on a GPU: bf16
autocast, so the weights are gathered in bf16 (engine.fsdp.gather_dtype, FSDP2's
`param_dtype`, as torchtitan and the user's FSDP2 program gather them):
- memory: `static_bytes / d` for the sharded states (fp32 weights 4 + gradients 4 + AdamW
  8 bytes per parameter, all sharded), plus a working set of whole units: FSDP2 all-gathers a
  unit's weights (bf16) before it runs, and its backward leaves bf16 gradients that FSDP
  copies to fp32 to reduce-scatter (UNIT_BYTES). At most LIVE_UNITS units are whole at once:
  the one running, the one prefetched, and the module's own parameters outside its layers
  (FSDP2 keeps the root's weights unsharded from forward until backward ends), counted as
  one more layer; a layer is taken as num_params / num_layers. The gathered weights are bf16
  already, so autocast keeps no bf16 copy of them for the backward (2 bytes a parameter that
  an unsharded module, or one gathered in fp32, holds for the whole module). A module of one
  layer is whole during its step: at d = 2 sharding it saves only those copies.
- communication per step: the bf16 weights all-gathered twice (forward, and again in backward
  since each layer frees them after its forward: `reshard_after_forward`) and the gradients
  reduce-scattered once in the reduce dtype (fp32, or bf16 with `reduce_dtype=bf16`), all
  over the placement's GPUs, in place of the all-reduce.
- optimizer: each GPU steps 1/d of the parameters.
"""

from __future__ import annotations

from mosaic.graph import ModuleSpec
from mosaic.tensor_parallel import autocast_weight_bytes

GATHER_BYTES = 2.0
"""Weights are gathered in bf16 (the engine's fp32 weights cast by FSDP2 under autocast)."""
GRAD_BYTES = 4.0
"""Gradients are reduce-scattered in fp32 by default, as the unsharded all-reduce sends them."""
UNIT_BYTES = GATHER_BYTES + 2.0 + GRAD_BYTES
"""A whole unit, per parameter: its gathered weight, the bf16 gradient its backward leaves, and
that gradient's fp32 copy that FSDP2 reduce-scatters."""
LIVE_UNITS = 3
"""Whole units at once: the running layer, the prefetched one, the module's own parameters."""
PARAM_ALL_GATHERS = 2
"""Weights are all-gathered in forward and again in backward (reshard after forward)."""


def units(spec: ModuleSpec) -> int:
    """FSDP2 units the engine shards the module into: one a layer and one for the rest (a
    module without layers is one unit)."""
    return spec.num_layers + 1 if spec.num_layers > 1 else 1


def working_set_bytes(spec: ModuleSpec) -> float:
    """Bytes of whole (all-gathered) weights and their unreduced gradients at the peak."""
    units = min(1.0, LIVE_UNITS / max(1, spec.num_layers))
    return UNIT_BYTES * spec.num_params * units


def state_bytes(spec: ModuleSpec, dp_degree: int, shard: bool) -> float:
    """Weights, gradients and optimizer state of `spec` on one GPU of its placement."""
    if not shard:
        return spec.static_bytes
    return spec.static_bytes / dp_degree + working_set_bytes(spec)


def added_bytes(spec: ModuleSpec, dp_degree: int) -> float:
    """What sharding over `dp_degree` GPUs adds to one GPU's need of `spec` (negative: it
    saves): the sharded states and whole units in place of the whole states, and no autocast
    copies of its weights (module doc)."""
    return (state_bytes(spec, dp_degree, shard=True) - spec.static_bytes
            - autocast_weight_bytes(spec))


def saved_bytes(spec: ModuleSpec, dp_degree: int) -> float:
    """Bytes per GPU that sharding over `dp_degree` GPUs saves (<= 0: it saves nothing; so for
    bf16 weights, which the engine does not shard: main_weights.bf16_weights_refusal)."""
    if dp_degree < 2 or spec.bf16_weights:
        return 0.0
    return -added_bytes(spec, dp_degree)


def saves_memory(spec: ModuleSpec, dp_degree: int) -> bool:
    return saved_bytes(spec, dp_degree) > 0


def all_gather_bytes(spec: ModuleSpec) -> float:
    """Bytes of one all-gather of the module's weights (the gathered size)."""
    return spec.num_params * GATHER_BYTES


def reduce_scatter_bytes(spec: ModuleSpec, wire_bytes: float = GRAD_BYTES) -> float:
    """Bytes of the gradients' reduce-scatter (each GPU's whole input), `wire_bytes` a
    parameter (the reduce dtype's size)."""
    return spec.num_params * wire_bytes
