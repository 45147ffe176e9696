"""Tensor parallelism in the engine: torch's `parallelize_module` (DTensor) on one DeviceMesh per
TP group; the cost model and its assumptions are in `mosaic.tensor_parallel`.

Which modules have a TP plan (`tp_plan`):
- a module with a `tp_plan(tensor_parallel)` method: the user's own plan (docs/own-model.md);
- the zoo's LLM sinks (`CausalLM` over a transformers Llama / Qwen2 decoder): Megatron-style,
  q/k/v/gate/up column-parallel, o/down row-parallel, so each layer all-reduces twice forward
  and twice backward; the LM head column-parallel with its logits gathered (the loss then sees
  the whole vocabulary) when the vocabulary splits evenly, else replicated. Norms, the input
  adapters and the rotary tables stay replicated.
- nothing else: encoders are small enough for data parallelism, and plan validation refuses
  `tensor_parallel > 1` for a module whose graph says `max_tensor_parallel = 1`.

Attention reads head counts in forward in some transformers versions (`self.num_heads`,
`self.num_key_value_heads`, `self.hidden_size` in 4.x) and infers them from the projection's
width in others (5.x: `view(*shape, -1, head_dim)`); the per-layer attributes that exist are
divided by t, as torchtitan does for its own models, so both work.

Every GPU of a TP group runs the same samples, so the parameters outside the plan (norms,
adapters) get the same gradients on each; data parallelism then sums each shard's gradients
over the GPUs that hold the same shard (`Placement.dp_groups`), by hand: DDP does not take
DTensor parameters (torch's `_pre_dp_module_transform` swaps the parameters every forward,
which would detach them from the optimizer the trainer has already built).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from mosaic.plan import TensorParallelError

TPPlan = dict[str, ParallelStyle]
HEAD_ATTRIBUTES = ("num_heads", "num_key_value_heads", "hidden_size")
"""Per-layer attention attributes older transformers versions read in forward."""


def tp_plan(module: nn.Module, tensor_parallel: int) -> TPPlan | None:
    """The `parallelize_module` plan that splits `module` `tensor_parallel` ways, or None when it
    has none. A user module's own `tp_plan(tensor_parallel)` method wins."""
    own = getattr(module, "tp_plan", None)
    if callable(own):
        return own(tensor_parallel)
    from mosaic.zoo.common import CausalLM

    if isinstance(module, CausalLM):
        return decoder_tp_plan(module, tensor_parallel)
    return None


def decoder_tp_plan(lm: nn.Module, tensor_parallel: int) -> TPPlan:
    """Megatron-style plan of a zoo CausalLM (Llama / Qwen2 decoder layers); divides each
    layer's attention head attributes by t (see module doc)."""
    t, backbone = tensor_parallel, lm.backbone
    config = backbone.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % t or kv_heads % t or config.intermediate_size % t:
        raise TensorParallelError(
            f"tensor_parallel={t} does not split {heads} attention heads, {kv_heads} KV heads "
            f"and MLP width {config.intermediate_size} evenly; use a common divisor")
    plan: TPPlan = {}
    for i, layer in enumerate(backbone.layers):
        prefix = f"backbone.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{prefix}.self_attn.{name}"] = ColwiseParallel()
        plan[f"{prefix}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{prefix}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{prefix}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{prefix}.mlp.down_proj"] = RowwiseParallel()
        _divide_head_attributes(layer.self_attn, t)
    if lm.lm_head.out_features % t == 0:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def _divide_head_attributes(attention: nn.Module, tensor_parallel: int) -> None:
    for name in HEAD_ATTRIBUTES:
        value = getattr(attention, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(attention, name, value // tensor_parallel)


def parallelize(name: str, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard `module` in place over the TP group's mesh (every rank of the group calls this:
    the weights are scattered from the group's first rank)."""
    t = mesh.size()
    plan = tp_plan(module, t)
    if not plan:
        raise TensorParallelError(
            f"module {name!r} is placed with tensor_parallel={t} but has no tensor-parallel "
            "plan: use tensor_parallel=1, or give the module a `tp_plan(tensor_parallel)` "
            "method returning a parallelize_module plan (docs/own-model.md)")
    return parallelize_module(module, mesh, plan)


def mesh_of(group: Any, device: torch.device) -> DeviceMesh:
    """A 1-D DeviceMesh over an existing process group (comm.py made it, on every rank)."""
    return DeviceMesh.from_group(group, device.type)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharing its storage), any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor a DTensor shards (a collective over its mesh), any other tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t
