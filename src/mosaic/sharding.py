"""Sharded training states (FSDP2, ZeRO-3 style): the cost facts the plan, the performance
model and the planners share.

A placement with `shard = True` keeps 1/d of its module's weights, gradients and optimizer
state on each of its d GPUs (torch's `fully_shard`, see `mosaic.engine.fsdp`) instead of a
full copy on each. The engine shards each layer of the module (the elements of its
`nn.ModuleList`s) as one unit and the module's remaining parameters (embeddings, norms,
heads) as one more, so only a few units are ever whole at once.

What the cost model assumes (counts, not measurements):
- memory: `static_bytes / d` for the sharded states (fp32 weights 4 + gradients 4 + AdamW
  8 bytes per parameter, all sharded), plus a working set of whole units: FSDP2 all-gathers a
  unit's fp32 weights before it runs and holds its fp32 gradients until they are
  reduce-scattered. At most LIVE_UNITS units are whole at once: the one running, the one
  prefetched, and the module's own parameters outside its layers (FSDP2 keeps the root's
  weights unsharded from forward until backward ends), counted as one more layer; a layer is
  taken as num_params / num_layers. A module of one layer is therefore whole during its step:
  at d = 2 sharding it saves nothing, and the planners do not shard it.
- communication per step: the fp32 weights all-gathered twice (forward, and again in backward
  since each layer frees them after its forward: `reshard_after_forward`) and the fp32
  gradients reduce-scattered once, all over the placement's GPUs, in place of the all-reduce.
- optimizer: each GPU steps 1/d of the parameters.
"""

from __future__ import annotations

from mosaic.graph import ModuleSpec

PARAM_BYTES = 4.0
"""The engine keeps fp32 weights (bf16 autocast computes): all-gathers move fp32."""
GRAD_BYTES = 4.0
"""Gradients are reduce-scattered in fp32, as the unsharded all-reduce sends them."""
LIVE_UNITS = 3
"""Whole units at once: the running layer, the prefetched one, the module's own parameters."""
PARAM_ALL_GATHERS = 2
"""Weights are all-gathered in forward and again in backward (reshard after forward)."""


def working_set_bytes(spec: ModuleSpec) -> float:
    """Bytes of whole (all-gathered) weights and their unreduced gradients at the peak."""
    units = min(1.0, LIVE_UNITS / max(1, spec.num_layers))
    return (PARAM_BYTES + GRAD_BYTES) * spec.num_params * units


def state_bytes(spec: ModuleSpec, dp_degree: int, shard: bool) -> float:
    """Weights, gradients and optimizer state of `spec` on one GPU of its placement."""
    if not shard:
        return spec.static_bytes
    return spec.static_bytes / dp_degree + working_set_bytes(spec)


def saved_bytes(spec: ModuleSpec, dp_degree: int) -> float:
    """Bytes per GPU that sharding over `dp_degree` GPUs saves (<= 0: it saves nothing; so for
    bf16 weights, which the engine does not shard: main_weights.bf16_weights_refusal)."""
    if dp_degree < 2 or spec.bf16_weights:
        return 0.0
    return spec.static_bytes - state_bytes(spec, dp_degree, shard=True)


def saves_memory(spec: ModuleSpec, dp_degree: int) -> bool:
    return saved_bytes(spec, dp_degree) > 0


def all_gather_bytes(spec: ModuleSpec) -> float:
    """Bytes of one all-gather of the module's weights (the gathered size)."""
    return spec.num_params * PARAM_BYTES


def reduce_scatter_bytes(spec: ModuleSpec) -> float:
    """Bytes of the gradients' reduce-scatter (each GPU's whole input)."""
    return spec.num_params * GRAD_BYTES
