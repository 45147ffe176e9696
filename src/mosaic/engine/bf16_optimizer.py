"""The optimizer of bf16 weights that the engine's flags ask for.

main_weights.MainWeightsAdamW keeps fp32 main copies; rounded_weights.RoundedWeightsAdamW
none; and, as `mosaic bench` variants until a GPU has measured them, the latter with its
launches grouped (grouped_update.py) or its first moment in 8 bits (fp8_first_moment.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from mosaic.engine.fp8_first_moment import Fp8FirstMomentAdamW
from mosaic.engine.grouped_update import GroupedRoundedWeightsAdamW
from mosaic.engine.main_weights import MainWeightsAdamW
from mosaic.engine.rounded_weights import bf16_weights_adamw


def bf16_optimizer(params: Iterable[nn.Parameter], lr: float, *, weight_decay: float = 0.0,
                   moments: str = "fp32", fp32_main_weights: bool = True,
                   update_group: int = 1, fp8_first_moment: bool = False) -> MainWeightsAdamW:
    """The optimizer of bf16 weights the engine's flags ask for: rounded_weights'
    (bf16_weights_adamw), its launches grouped where `update_group` > 1, or its first moment
    in 8 bits (engine/fp8_first_moment.py)."""
    if fp8_first_moment:
        if fp32_main_weights or moments != "bf16" or update_group > 1:
            raise ValueError("fp8_first_moment needs bf16 moments, no fp32 main weights and "
                             "update_group 1")
        return Fp8FirstMomentAdamW(params, lr, weight_decay=weight_decay)
    if update_group > 1:
        if fp32_main_weights:
            raise ValueError("update_group groups the update without fp32 main weights: set "
                             "fp32_main_weights=False too, or leave update_group 1")
        return GroupedRoundedWeightsAdamW(params, lr, group=update_group,
                                          weight_decay=weight_decay, moments=moments)
    return bf16_weights_adamw(params, lr, weight_decay=weight_decay, moments=moments,
                              fp32_main_weights=fp32_main_weights)
