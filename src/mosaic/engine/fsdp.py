"""Sharded training states of one data-parallel module: torch's FSDP2 (`fully_shard`) on a
DeviceMesh over the module's own process group, in place of DDP (mosaic.sharding says what it
costs, docs/engine.md how it runs).

Units. Each layer (an element of one of the module's nn.ModuleList / nn.ModuleDict containers:
transformer blocks, adapters, projections) is sharded as one unit, then the module itself,
which takes the parameters left over (embeddings, norms, heads). FSDP2 all-gathers a unit just
before it runs and frees it after, so only a few units are whole at once: the memory model of
mosaic.sharding. A layer with a parameter that also appears elsewhere in the module (tied
weights) stays in the module's unit: FSDP2 needs each parameter in exactly one unit.

Scale. The engine scales each loss so that gradients SUM over replicas to the gradient of the
global loss (runner.py), while FSDP2 averages by default. So every unit reduce-scatters with a
plain SUM and divides only by `divide_by` (the DP degree for a contrastive head, whose replicas
each compute the full gradient; 1 otherwise), as the DDP hook does (ddp.py). A plain SUM, not
NCCL's PREMUL_SUM, because gloo has no PREMUL_SUM and the CPU tests run on gloo.

Precision. Under bf16 autocast the weights are gathered in bf16 (`gather_dtype`: FSDP2's
`param_dtype`, as torchtitan and the user's FSDP2 program gather them), their sharded fp32
copies stay what the optimizer steps, and the gradients are reduce-scattered in the reduce
dtype (fp32 by default).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)
"""Containers have no forward of their own: FSDP2 unshards a unit in its forward hook, so a
container cannot be a unit; its elements are."""


def gather_dtype(amp: bool) -> torch.dtype | None:
    """What a sharded module's weights are gathered in: bf16 where autocast computes in bf16,
    so the all-gathers and the gathered units take half the bytes of fp32 and autocast makes
    no bf16 copy of each weight to keep for the backward (mosaic.sharding counts both); as
    stored (None) otherwise."""
    return torch.bfloat16 if amp else None


def shard_module(module: nn.Module, group: Any, device: torch.device, *, divide_by: int = 1,
                 param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    """Shard `module` in place over the GPUs of `group` (its parameters become DTensor shards:
    build the optimizer after this; the module is now also an FSDPModule), its weights
    gathered in `param_dtype` (None: as stored; `gather_dtype`); `group` may be a DeviceMesh
    (`hybrid_mesh`). Returns the parameters left whole on every GPU, whose gradients the
    caller must all-reduce: the scalars (a contrastive head's temperature), which fully_shard
    cannot shard."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    mesh = group if isinstance(group, DeviceMesh) else DeviceMesh.from_group(group, device.type)
    return shard_modules(module, [module], mesh, policy, divide_by)


def hybrid_mesh(replica_group: Any, shard_group: Any, shard_groups: Sequence[Sequence[int]],
                device: torch.device) -> DeviceMesh:
    """The 2-D mesh of hybrid sharding (HSDP, Placement.shard_degree): dimension 0 the copies
    (this rank's `replica_group`: the GPUs holding its shard in every copy), dimension 1 the
    GPUs of one copy (`shard_group`); `shard_groups` lists every copy's GPUs, in order. FSDP2
    shards over dimension 1 and all-reduces the reduce-scattered gradients over dimension 0."""
    ranks = torch.tensor([list(g) for g in shard_groups], dtype=torch.int)
    return DeviceMesh.from_group([replica_group, shard_group], device.type, mesh=ranks,
                                 mesh_dim_names=("replicate", "shard"))


def shard_program(program: nn.Module, modules: list[nn.Module], mesh: DeviceMesh, *,
                  divide_by: int, param_dtype: torch.dtype | None = None,
                  reduce_dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    """What a user writes with FSDP2 (torchtitan's recipe): each module's layers, then each
    module, then `program` (the root, which holds `modules`) sharded over `mesh`, the weights
    gathered in `param_dtype` (None: as stored) and the gradients reduced in `reduce_dtype`.
    Returns the scalars left whole, as shard_module does."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    return shard_modules(program, modules, mesh, policy, divide_by)


def shard_modules(root: nn.Module, modules: list[nn.Module], mesh: DeviceMesh,
                  policy: MixedPrecisionPolicy, divide_by: int) -> list[nn.Parameter]:
    """Every module's layer units, then every module, then `root` (when it is not one of
    them), each a unit; the gradients of all SUM and are divided by `divide_by`."""
    whole = [p for p in root.parameters() if p.dim() == 0]

    def shard(unit: nn.Module) -> None:
        fully_shard(unit, mesh=mesh, mp_policy=policy, ignored_params=set(whole))

    for module in modules:
        for unit in layer_units(module):
            shard(unit)
        shard(module)
    if all(root is not m for m in modules):
        shard(root)
    for unit in root.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(float(divide_by))
            unit.set_force_sum_reduction_for_comms(True)
    return whole


def layer_units(module: nn.Module) -> list[nn.Module]:
    """The outermost non-container elements of the module's containers that hold parameters,
    none of them shared with the rest of the module, in module order."""
    counts = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    units: list[nn.Module] = []

    def visit(parent: nn.Module, in_container: bool) -> None:
        for child in parent.children():
            if isinstance(child, _CONTAINERS):
                visit(child, True)
            elif in_container and any(True for _ in child.parameters()):
                if all(counts[id(p)] == 1 for p in child.parameters()):
                    units.append(child)
            else:
                visit(child, False)

    visit(module, False)
    return units

