"""bf16 weights without fp32 main copies: the update rounds each new weight stochastically.

MainWeightsAdamW (engine/main_weights.py) keeps an fp32 main copy of every bf16 weight, so
its update reads and writes 8 bytes a parameter for the copy alone: with bf16 moments it moves
20 bytes a parameter (main 4 + 4, gradient 2, moments 2 x (2 + 2), bf16 weight 2), and on one
H200 that update is what bounds Unified-IO 2 `paper` at its preset batch (BENCHMARKS.md).
Here the bf16 weight is the only copy: the update reads it, computes AdamW's new weight in
fp32 exactly as MainWeightsAdamW does, and writes it back rounded to bf16 stochastically
(main_weights.stochastic_bf16: up or down with the chance of each proportional to its
nearness). With bf16 moments that is 14 bytes a parameter moved and 10 held (weight 2,
gradient 2, moments 4, the flat gradient copy 2) instead of 20 and 14.

Why not round to nearest: an AdamW step changes a weight by about lr, relative to it often
below half a bf16 unit (2^-9 = 0.2%), and rounding to nearest then drops the change every
step: the weight stalls. Rounded stochastically, the expected weight after a step is the fp32
one, so small steps add up as they do on the fp32 copy (tests/test_rounded_weights.py shows
both on a problem whose steps are all below half a unit). Training with bf16 weights kept so
is the recipe of "Revisiting BFloat16 Training" (Zamirai et al., 2020) and of torchao's
bf16 stochastic-rounding AdamW; what it changes on a real task here is measured in
BENCHMARKS.md.

The rounding's bits come from the draw the moments round with (main_weights.hashed_bits of
each element's index and new value and of the step count), remixed by one multiply so that
they are not the moments' own bits: data-parallel replicas, which hold equal weights and
gradients, round equally and stay equal, and a run resumed from a checkpoint rounds as the
uninterrupted one did. A second hash with its own seed, as first shipped, made the update
compute-bound: on the H200 a flat update of 2^28 parameters took 1.18 ms (3.2 TB/s) against
0.95 ms remixed, which is what rounding to nearest takes (benchmarks/rounded_update_bits.py).

The update is one Inductor kernel per launch (a module over the flat gradient buffer, else a
weight), compiled for each length as MainWeightsAdamW's kernels of one length are; past
main_weights.MAX_STATIC_KERNELS lengths in a process, further lengths update eagerly.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mosaic.engine.main_weights import (
    MOMENT_DTYPES,
    MainWeightsAdamW,
    _adamw_update,
    _adjacent_runs,
    _flat,
    hashed_bits,
    stochastic_bf16,
)

REMIX = -1640531535
"""An odd multiplier (2^32 over the golden ratio, as int32): the weight's 16 bits are the top
half of the draw times it. Given either moment's 16 bits, they are still spread evenly."""


def weight_bits(main: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The 16 bits (int32 in [0, 2^16)) the new weight `main` rounds with: the moments' draw
    (the same expression as main_weights._adamw_update's, which Inductor computes once in the
    fused kernel) remixed. With fp32 moments it is the only draw."""
    return ((hashed_bits(main, step) * REMIX) >> 16) & 0xFFFF


def _rounded_update(grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    weight: torch.Tensor, lr: torch.Tensor, step_size: torch.Tensor,
                    bias2_sqrt: torch.Tensor, found_inf: torch.Tensor, grad_scale: torch.Tensor,
                    step: torch.Tensor, *, beta1: float, beta2: float, eps: float,
                    weight_decay: float) -> None:
    """MainWeightsAdamW's step of one bf16 `weight` with its main weight read from the weight
    itself and the new one written back by stochastic rounding. The fp32 main and the
    nearest-rounded bf16 that _adamw_update writes are temporaries: compiled, they stay in
    registers (one kernel, nothing but weight, gradient and moments read or written)."""
    main = weight.float()
    nearest = torch.empty_like(weight)
    _adamw_update(main, grad, exp_avg, exp_avg_sq, nearest, lr, step_size, bias2_sqrt,
                  found_inf, grad_scale, step, beta1=beta1, beta2=beta2, eps=eps,
                  weight_decay=weight_decay)
    weight.copy_(stochastic_bf16(main, weight_bits(main, step)))


@functools.lru_cache(maxsize=8)
def _rounded_update_fn(device_type: str, beta1: float, beta2: float, eps: float,
                       weight_decay: float):
    """The update with its constants bound; on CUDA compiled for each length (Dynamo's
    recompile limit raised as for MainWeightsAdamW's kernels of one length)."""
    update = functools.partial(_rounded_update, beta1=beta1, beta2=beta2, eps=eps,
                               weight_decay=weight_decay)
    if device_type != "cuda":
        return update
    from mosaic.engine.compile import raise_recompile_limit

    raise_recompile_limit()
    return torch.compile(update, dynamic=False)


class RoundedWeightsAdamW(MainWeightsAdamW):
    """MainWeightsAdamW whose bf16 weights have no fp32 main copy (module doc): the state of
    a bf16 weight is AdamW's (`step`, `exp_avg`, `exp_avg_sq`), in `moments`' dtype; the fp32
    parameters are torch's fused AdamW's, as there. Its checkpoint has no `main`: an optimizer
    keeping main weights refuses it (engine/checkpoint.py names the flag), while a state saved
    with main weights loads here without them (the switch drops the copies, as asked)."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, moments: str = "bf16") -> None:
        super().__init__(params, lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         dynamic=False, moments=moments)

    def _add_flat_state(self, run: list[nn.Parameter]) -> None:
        """The moments of weights that lie side by side, as views into flat buffers laid out
        as the weights are (no main copy)."""
        n = sum(p.numel() for p in run)
        exp_avg, exp_avg_sq = (torch.zeros(n, device=run[0].device,
                                           dtype=MOMENT_DTYPES[self.moments]) for _ in range(2))
        start = 0
        for p in run:
            end = start + p.numel()
            self.state[p] = {"step": self._step, "exp_avg": exp_avg[start:end].view(p.shape),
                             "exp_avg_sq": exp_avg_sq[start:end].view(p.shape)}
            start = end

    def launch_runs(self) -> list[list[nn.Parameter]]:
        """As MainWeightsAdamW's, the moments standing for the main weights' layout."""
        with_grad = [p for p in self.bf16 if p.grad is not None]
        runs = []
        for run in _adjacent_runs(with_grad, lambda p: p.data):
            for grads_run in _adjacent_runs(run, lambda p: p.grad):
                runs += _adjacent_runs(grads_run, lambda p: self.state[p]["exp_avg"])
        return runs

    def _bind_update(self) -> None:
        group = self.param_groups[0]
        constants = (self._step.device.type, *group["betas"], group["eps"], group["weight_decay"])
        self._constants = (*constants, self.moments, "rounded")  # its own kernel budget keys
        self._update_any_length = None
        self._update_one_length = _rounded_update_fn(*constants)
        self.graphs = {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = {index: {k: v for k, v in values.items() if k != "main"}
                 for index, values in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": saved})

    @property
    def mains(self) -> list[torch.Tensor]:
        """The weights themselves: they are the only copy."""
        return [p.detach() for p in self.bf16]

    def _bf16_step(self) -> None:
        beta1, beta2 = self.param_groups[0]["betas"]
        self._step += 1 - self._found_inf
        step_size = self._lr / (1 - torch.pow(beta1, self._step))
        bias2_sqrt = torch.sqrt(1 - torch.pow(beta2, self._step))
        for run in self.launch_runs():
            state = self.state[run[0]]
            n = sum(p.numel() for p in run)
            tensors = (run[0].grad, state["exp_avg"], state["exp_avg_sq"], run[0].data)
            self._kernel(n)(*(_flat(t, n) for t in tensors), self._lr, step_size, bias2_sqrt,
                            self._found_inf, self._grad_scale, self._step)


def bf16_weights_adamw(params: Iterable[nn.Parameter], lr: float, *, weight_decay: float = 0.0,
                       moments: str = "fp32", fp32_main_weights: bool = True
                       ) -> MainWeightsAdamW:
    """The optimizer of bf16 weights the engine's flags ask for: fp32 main copies
    (MainWeightsAdamW) or none (RoundedWeightsAdamW)."""
    if fp32_main_weights:
        return MainWeightsAdamW(params, lr, weight_decay=weight_decay, moments=moments)
    return RoundedWeightsAdamW(params, lr, weight_decay=weight_decay, moments=moments)
