"""The update without main weights with AdamW's first moment in 8 bits: 12 bytes a parameter.

RoundedWeightsAdamW with bf16 moments reads and writes 14 bytes a parameter (weight 2 + 2,
gradient 2, moments 2 x (2 + 2)); on one H200 its 14.9 ms bound Unified-IO 2 `paper` at its
preset batch (BENCHMARKS.md). Here the first moment is float8 e4m3 with a float32 scale per
BLOCK elements (the block's largest value stored as e4m3's largest, 448), rounded
stochastically; the second stays bf16. That is the split FP8-LM (Peng et al., 2023) trains
with, and the one benchmarks/fp8_moments_digits.py found sound: over 3000 steps of a
synthetic gradient stream the update direction stays within 8% of fp32 moments' (bf16
moments: 2%), where the second moment in e4m3 too drifted 37-46% (e4m3's 3 mantissa bits
cannot follow a second moment that moves 0.1% a step; the first forgets its rounding within
tens of steps at beta1 = 0.9).

Each weight is its own launch (one Inductor kernel: the block scales are a reduction over
rows of BLOCK, fused with the update around it), its first moment padded to whole blocks:
with the update a weight at a time only (`bf16_flat_grads=False`). The rounding bits are
the engine's hashed draw (main_weights.hashed_bits of the new weight and the step count):
8 for the first moment, 16 for the second, the weight's remixed (rounded_weights
.weight_bits), so replicas and resumed runs round alike.

A bench variant (`fp32_main_weights=false,fp8_first_moment=true`), in a file of its own:
the update's files carry a digest in every profiled update entry; not profiled, the model
prices it as the bf16-moment update, and `mosaic train` refuses it until a GPU has
measured it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from mosaic.engine.compile import compiled_update
from mosaic.engine.main_weights import hashed_bits, stochastic_bf16
from mosaic.engine.rounded_weights import RoundedWeightsAdamW, weight_bits

BLOCK = 256
"""Elements sharing one scale (torchao's and bitsandbytes' block-wise 8-bit states use blocks
of this order): 4 bytes of scale per 256 one-byte moments."""
FP8_TOP = 448.0
"""float8 e4m3's largest finite value."""
SUBNORMAL_STEP = 2.0 ** -9
"""e4m3's spacing below its smallest normal value, 2^-6."""


def fp8_stochastic(x: torch.Tensor, bits8: torch.Tensor) -> torch.Tensor:
    """fp32 `x` (within ±448) to e4m3, up or down at random with the chance of each
    proportional to its nearness, on 8 random bits (int32 in [0, 256)): below the smallest
    normal on e4m3's even grid, above it by adding the bits under the 3 mantissa bits kept
    and truncating (on the magnitude: IEEE floats are sign and magnitude)."""
    uniform = (bits8.float() + 0.5) / 256
    subnormal = torch.floor(x / SUBNORMAL_STEP + uniform) * SUBNORMAL_STEP
    top = x.clamp(-FP8_TOP * 0.99, FP8_TOP * 0.99)  # the noise cannot carry past 448
    normal = ((top.view(torch.int32) + (bits8 << 12)) & -(1 << 20)).view(torch.float32)
    return torch.where(x.abs() < 2.0 ** -6, subnormal, normal).to(torch.float8_e4m3fn)


def block_scaled(x: torch.Tensor, bits8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat fp32 `x` (whole blocks) as e4m3 codes and a scale per block (0 for a block of
    zeros), rounded on `bits8`."""
    blocks = x.view(-1, BLOCK)
    scale = blocks.abs().amax(dim=1) / FP8_TOP
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    return fp8_stochastic(blocks / divisor[:, None], bits8.view(-1, BLOCK)).view(-1), scale


def _first_moment_update(grad: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                         exp_avg_sq: torch.Tensor, weight: torch.Tensor, lr: torch.Tensor,
                         step_size: torch.Tensor, bias2_sqrt: torch.Tensor,
                         found_inf: torch.Tensor, grad_scale: torch.Tensor, step: torch.Tensor,
                         *, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW step of one flat bf16 `weight` (main_weights._adamw_update's arithmetic)
    with its first moment in `codes` x `scale` (padded to whole blocks) and its second in
    bf16; nothing changes where `found_inf` is set."""
    n, pad = weight.numel(), codes.numel() - weight.numel()
    skip = found_inf > 0
    g = F.pad(grad.float() / grad_scale, (0, pad))
    main = F.pad(weight.float(), (0, pad))
    m_old = (codes.float().view(-1, BLOCK) * scale[:, None]).view(-1)
    v_old = F.pad(exp_avg_sq.float(), (0, pad))
    m = m_old + (g - m_old) * (1 - beta1)
    v = v_old * beta2 + g * g * (1 - beta2)
    new = main * (1 - lr * weight_decay) - step_size * m / (v.sqrt() / bias2_sqrt + eps)
    new, v = torch.where(skip, main, new), torch.where(skip, v_old, v)
    bits = hashed_bits(new, step)
    new_codes, new_scale = block_scaled(m, bits & 0xFF)
    # Selected as bytes: Inductor's CPU code generator cannot promote a select's bool with float8
    codes.view(torch.uint8).copy_(torch.where(skip, codes.view(torch.uint8),
                                              new_codes.view(torch.uint8)))
    scale.copy_(torch.where(skip, scale, new_scale))
    exp_avg_sq.copy_(stochastic_bf16(v, (bits >> 16) & 0xFFFF)[:n])
    weight.copy_(stochastic_bf16(new, weight_bits(new, step))[:n])


@functools.lru_cache(maxsize=8)
def _first_moment_update_fn(device_type: str, beta1: float, beta2: float, eps: float,
                            weight_decay: float):
    """The update with its constants bound; on CUDA compiled for each length."""
    return compiled_update(functools.partial(_first_moment_update, beta1=beta1, beta2=beta2,
                                             eps=eps, weight_decay=weight_decay), device_type)


class Fp8FirstMomentAdamW(RoundedWeightsAdamW):
    """RoundedWeightsAdamW with each bf16 weight's first moment in block-scaled e4m3 and its
    second in bf16 (module doc); a launch a weight. Its state per bf16 weight: `exp_avg`
    (e4m3 codes, padded to whole blocks), `exp_avg_scale`, `exp_avg_sq` (bf16) and `step`; a
    state saved by another bf16 optimizer holds other keys, which MainWeightsAdamW's
    load_state_dict refuses."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, moments: str = "bf16") -> None:
        if moments != "bf16":
            raise ValueError(f"moments={moments!r}: the second moment stays bf16 here "
                             "(moments='bf16')")
        super().__init__(params, lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         moments=moments)

    def _add_flat_state(self, run: list[nn.Parameter]) -> None:
        for p in run:
            padded = -(-p.numel() // BLOCK) * BLOCK
            self.state[p] = {
                "step": self._step,
                "exp_avg": torch.zeros(padded, device=p.device, dtype=torch.float8_e4m3fn),
                "exp_avg_scale": torch.zeros(padded // BLOCK, device=p.device),
                "exp_avg_sq": torch.zeros(p.shape, device=p.device, dtype=torch.bfloat16)}

    def launch_runs(self) -> list[list[nn.Parameter]]:
        return [[p] for p in self.bf16 if p.grad is not None]

    def _bind_update(self) -> None:
        group = self.param_groups[0]
        constants = (self._step.device.type, *group["betas"], group["eps"], group["weight_decay"])
        self._constants = (*constants, "fp8-first-moment")  # its own kernel budget keys
        self._update_any_length = None
        self._update_one_length = _first_moment_update_fn(*constants)
        self.graphs = {}

    def _bf16_step(self) -> None:
        beta1, beta2 = self.param_groups[0]["betas"]
        self._step += 1 - self._found_inf
        step_size = self._lr / (1 - torch.pow(beta1, self._step))
        bias2_sqrt = torch.sqrt(1 - torch.pow(beta2, self._step))
        for [p] in self.launch_runs():
            state = self.state[p]
            self._kernel(p.numel())(p.grad.view(-1), state["exp_avg"], state["exp_avg_scale"],
                                    state["exp_avg_sq"].view(-1), p.data.view(-1), self._lr,
                                    step_size, bias2_sqrt, self._found_inf, self._grad_scale,
                                    self._step)
