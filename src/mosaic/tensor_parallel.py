"""Tensor parallelism (TP): the cost facts the plan, the performance model and the planners share.

A placement with `tensor_parallel = t` cuts its GPUs into groups of t consecutive GPUs. Each
group holds ONE replica of the module, its weights split Megatron-style (attention heads and
MLP columns t ways: q/k/v/gate/up column-parallel, o/down row-parallel; the engine applies
torch's `parallelize_module`, see `mosaic.engine.tensor_parallel`), and every GPU of a group
sees the same samples. DP degree = len(gpus) // t; gradients are all-reduced over the GPUs that
hold the same shard (one per group).

What the cost model assumes (counts, not measurements):
- compute: each GPU of a group runs 1/t of the replica's forward + backward at the replica's
  batch, i.e. the module's measured (or roofline) time at that batch divided by t;
- communication: per transformer layer, 2 all-reduces forward (after attention's and the MLP's
  row-parallel projection) and 2 backward (their column-parallel inputs' gradients), each of
  the activations [per-GPU batch, tokens, hidden] in bf16, over the TP group (inside a node);
- memory: weights, gradients and optimizer state / t; activations: Megatron-LM's count without
  sequence parallelism (Korthikanti et al. 2022): of the 34 bytes a layer keeps per token and
  hidden unit, 10 (layer-norm inputs, residual stream) stay whole on every GPU of the group and
  24 split t ways; so (10 + 24 / t) / 34 of the activations.
"""

from __future__ import annotations

from dataclasses import replace

from mosaic.graph import ModuleSpec
from mosaic.hardware import ClusterSpec

TP_DEGREES = (1, 2, 4, 8)
"""Degrees the planners consider (an HGX node has 8 GPUs on NVSwitch; TP stays inside a node)."""
ALLREDUCES_PER_LAYER = 4
"""Two forward (attention out, MLP out) and two backward (their inputs' gradients)."""
ACTIVATION_BYTES = 2
"""TP all-reduces move bf16 activations."""
AUTOCAST_WEIGHT_BYTES = 2.0
REPLICATED_ACTIVATIONS = 10 / 34
"""Share of a layer's saved activations that every GPU of a TP group keeps whole."""


def activation_fraction(tensor_parallel: int) -> float:
    """Share of the module's activations one GPU of a TP group keeps (1.0 without TP)."""
    t = tensor_parallel
    return 1.0 if t == 1 else REPLICATED_ACTIVATIONS + (1 - REPLICATED_ACTIVATIONS) / t


def bytes_per_gpu(spec: ModuleSpec, per_gpu_batch: int, tensor_parallel: int = 1) -> float:
    """Weights + gradients + optimizer state + the weights' bf16 copies + activations of `spec`
    on one GPU of its placement, `per_gpu_batch` being the replica's batch (global batch / DP
    degree)."""
    t = tensor_parallel
    return ((spec.static_bytes + autocast_weight_bytes(spec)) / t
            + spec.activation_bytes_per_sample * per_gpu_batch * activation_fraction(t))


def bf16_precision_saving(spec: ModuleSpec, *, main_weights: bool = True) -> tuple[float, str]:
    """Bytes a GPU holding `spec` whole would save if `mosaic train` kept its GEMM weights and
    their moments in bf16, updated a weight at a time (without fp32 main copies unless
    `main_weights`), and the flags that ask for it (0 and "" when it already does, or its graph
    does not count its bf16 weights)."""
    lean = replace(spec, bf16_weights=True, bf16_moments=True, bf16_flat_grads=False,
                   fp32_main_weights=spec.fp32_main_weights and main_weights)
    saved = bytes_per_gpu(spec, 0) - bytes_per_gpu(lean, 0)
    flags = [flag for flag, have in (("--bf16-weights", spec.bf16_weights),
                                     ("--bf16-moments", spec.bf16_moments),
                                     ("--no-bf16-flat-grads", not spec.bf16_flat_grads),
                                     ("--no-fp32-main-weights",
                                      main_weights or not spec.fp32_main_weights))
             if not have]
    return (saved, " ".join(flags)) if saved > 0 else (0.0, "")


def autocast_weight_bytes(spec: ModuleSpec) -> float:
    """The bf16 copy of every fp32 weight that autocast makes in the forward and the backward
    keeps until it has used it: live at the end of the forward, the memory peak. Not a
    sharded module's: FSDP gathers its weights in bf16 (mosaic.sharding.added_bytes takes
    them off). Weights stored in bf16 (ModuleSpec.bf16_weights) are used as they are."""
    return AUTOCAST_WEIGHT_BYTES * (spec.num_params - spec.stored_bf16_params)


def allreduce_bytes(spec: ModuleSpec, per_gpu_batch: int) -> float:
    """Bytes of one TP all-reduce: the replica's activations [batch, tokens, hidden] in bf16."""
    return per_gpu_batch * spec.tokens_per_sample * spec.hidden_dim * ACTIVATION_BYTES


def allreduces_per_step(spec: ModuleSpec) -> int:
    """TP all-reduces in one forward + backward of the module."""
    return ALLREDUCES_PER_LAYER * max(1, spec.num_layers)


def supports(spec: ModuleSpec, tensor_parallel: int) -> bool:
    """Whether the module's TP plan splits evenly `tensor_parallel` ways."""
    return tensor_parallel == 1 or spec.max_tensor_parallel % tensor_parallel == 0


def degrees(spec: ModuleSpec, cluster: ClusterSpec) -> tuple[int, ...]:
    """TP degrees worth planning for the module: in TP_DEGREES, supported, inside one node;
    only 1 for bf16 weights, which the engine does not split (main_weights.bf16_weights_refusal)."""
    if spec.bf16_weights:
        return (1,)
    return tuple(t for t in TP_DEGREES
                 if supports(spec, t) and t <= min(cluster.gpus_per_node, cluster.num_gpus))
