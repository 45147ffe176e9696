"""Gradient synchronisation of one data-parallel module: torch's DistributedDataParallel on
the module's own process group, with a communication hook that keeps the engine's scale.

The engine scales each loss so that gradients SUM to the gradient of the global loss (see
runner.py), while DDP averages by default. The hook all-reduces with SUM and divides only by
`divide_by` (the DP degree for a contrastive head, whose replicas each compute the full
gradient of its parameters; 1 otherwise). With `reduce_dtype=bf16` the bucket travels in bf16,
as Megatron's and FSDP's mixed-precision reduction do, and is written back in fp32.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as real objects.
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

BUCKET_CAP_MB = 100
"""DDP bucket size: a whole module's backward is one CUDA-graph replay, so buckets become ready
together at its end; large buckets mean fewer collective launches."""


@dataclass(frozen=True, slots=True)
class _HookState:
    group: Any
    divide_by: int
    reduce_dtype: torch.dtype


def _sum_hook(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    wire = buffer if buffer.dtype == state.reduce_dtype else buffer.to(state.reduce_dtype)
    if state.divide_by != 1:
        wire.div_(state.divide_by)  # before the sum: bf16 keeps its range
    future = dist.all_reduce(wire, group=state.group, async_op=True).get_future()

    def write_back(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        reduced = fut.value()[0]
        if reduced is not buffer:
            buffer.copy_(reduced)
        return buffer

    return future.then(write_back)


def wrap_ddp(module: nn.Module, group: Any, device: torch.device, *, divide_by: int = 1,
             reduce_dtype: torch.dtype = torch.float32,
             bucket_view: bool = False) -> DistributedDataParallel:
    """DDP around `module` (the runner's callable; CUDA-graph capture later replaces its forward
    in place, so the wrapper stays valid). Replicas already
    hold identical weights (seeded per module), so construction does not broadcast them.
    Not `static_graph`: its first-iteration bookkeeping went wrong (a module's gradients lost,
    caught by the bench's gradient check) when two plans' DDP wrappers share parameters, as
    in `mosaic bench`; unused parameters are ignored explicitly instead (runner.py).

    `bucket_view`: gradients are views into the buckets, so a reduced bucket needs no copy back
    into each gradient. A torch.profiler trace of a data-parallel CLIP `paper` step on 2 x H200
    found the host the bottleneck, with two copies per parameter tensor per step (into the
    bucket and back, ~800 launches); this removes the second. Off by default until measured."""
    ddp = DistributedDataParallel(
        module, device_ids=[device] if device.type == "cuda" else None, process_group=group,
        broadcast_buffers=False, bucket_cap_mb=BUCKET_CAP_MB, gradient_as_bucket_view=bucket_view,
        static_graph=False, init_sync=False)
    ddp.register_comm_hook(_HookState(group, divide_by, reduce_dtype), _sum_hook)
    return ddp
