"""The update a weight at a time, same-shaped weights K at a time in one launch.

Without a flat gradient buffer (`bf16_flat_grads=False`), RoundedWeightsAdamW launches one
Inductor kernel a weight: Unified-IO 2 `paper`'s LLM takes 339 launches and 14.37 ms on the
H200 where one launch over the same weights in flat buffers takes 12.67 (profile, 2026-12-04):
each launch ramps up and drains on its own. Here the launches are queued as the step makes
them and run same-shaped weights K at a time through one compiled function with Inductor's
combo kernels on, which puts up to 8 independent pointwise kernels into one launch (its
`combo_kernel_max_num_nodes`; a larger group is one compiled function in more launches). A
transformer's layers repeat their weights' shapes, so a few compiles serve every layer.

Each weight's arithmetic and rounding bits are the engine's (the bits hash an element's
index within its own weight, not its place in a launch): the weights and moments come out
bit for bit RoundedWeightsAdamW's (tests/test_grouped_update.py on the CPU; on the GPU,
tests/gpu/test_rounded_weights_gpu.py). Only without fp32 main weights, the leanest update
and the one that bounds Unified-IO 2 `paper` at its preset batch.

In a file of its own and opt-in (`--engine-variant ...,update_group=8`): the update's files
carry a digest in every profiled update entry, and the profile has not measured this launch
layout, so the performance model prices it as the update a weight at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn

from mosaic.engine.compile import compiled_update
from mosaic.engine.rounded_weights import RoundedWeightsAdamW, _rounded_update


def _group_update(runs: tuple[tuple[torch.Tensor, ...], ...], *scalars: torch.Tensor,
                  beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    for grad, exp_avg, exp_avg_sq, weight in runs:
        _rounded_update(grad, exp_avg, exp_avg_sq, weight, *scalars, beta1=beta1, beta2=beta2,
                        eps=eps, weight_decay=weight_decay)


@functools.lru_cache(maxsize=8)
def _group_update_fn(device_type: str, beta1: float, beta2: float, eps: float,
                     weight_decay: float):
    """The group's update with its constants bound; on CUDA compiled with combo kernels, for
    each set of shapes."""
    return compiled_update(functools.partial(_group_update, beta1=beta1, beta2=beta2, eps=eps,
                                             weight_decay=weight_decay), device_type,
                           combo_kernels=True)


class GroupedRoundedWeightsAdamW(RoundedWeightsAdamW):
    """RoundedWeightsAdamW whose launches run `group` same-shaped weights at a time through
    one compiled function (module doc). Its state and checkpoints are RoundedWeightsAdamW's."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float, *, group: int,
                 **kwargs) -> None:
        if group < 2:
            raise ValueError(f"group={group}: group two or more weights a launch (1: use "
                             "RoundedWeightsAdamW)")
        self.group = group
        self._queued: dict[tuple[int, ...], list[tuple[torch.Tensor, ...]]] = {}
        super().__init__(params, lr, **kwargs)

    def _bf16_step(self) -> None:
        self._queued = {}
        super()._bf16_step()  # its launches land in the queue (_kernel)
        update = _group_update_fn(*self._constants[:5])
        for launches in self._queued.values():
            for start in range(0, len(launches), self.group):
                chunk = launches[start:start + self.group]
                update(tuple(args[:4] for args in chunk), *chunk[0][4:])

    def _kernel(self, length: int):
        def queue(*args: torch.Tensor) -> None:
            self._queued.setdefault(tuple(args[0].shape), []).append(args)
        return queue
