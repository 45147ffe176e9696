"""The learning rate of each optimizer step: a linear warm-up, then a constant, linear or
cosine decay to a floor, as Megatron-LM (`--lr-warmup-iters`, `--lr-decay-style`, `--min-lr`)
and torchtitan (`lr_scheduler.warmup_steps`, `decay_type`, `lr_min`) offer.

A pure function of the step and the run's length, so a resumed run continues on the same
curve with no scheduler state in its checkpoint. The trainer writes it into the optimizer's
`param_groups` before each step; the captured optimizer reads its learning rate from a device
tensor that its step refills when the group's changes (engine/main_weights.py), so a schedule
costs no host sync and no new capture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mosaic.errors import MosaicError

DECAYS = ("constant", "linear", "cosine")


class ScheduleError(MosaicError):
    """A learning-rate schedule that cannot be used; the message names the option."""


@dataclass(frozen=True, slots=True)
class LRSchedule:
    peak: float
    """The learning rate after warm-up (`--lr`)."""
    total_steps: int
    """The run's optimizer steps (`--steps`): a decay reaches `min_lr` at the last."""
    warmup_steps: int = 0
    """Steps 0..W-1 ramp linearly from peak / W to peak."""
    decay: str = "constant"
    """After warm-up: 'constant' (peak), 'linear' or 'cosine' from peak to min_lr."""
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        if self.decay not in DECAYS:
            raise ScheduleError(f"lr decay {self.decay!r}; use one of {', '.join(DECAYS)} "
                                "(--lr-decay)")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ScheduleError(f"lr warm-up of {self.warmup_steps} steps must be within the "
                                f"run's {self.total_steps} (--lr-warmup-steps)")
        if not 0 <= self.min_lr <= self.peak:
            raise ScheduleError(f"min_lr={self.min_lr} must be in [0, lr={self.peak}] "
                                "(--min-lr)")

    @property
    def constant(self) -> bool:
        return self.warmup_steps == 0 and self.decay == "constant"

    def at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return self.peak * (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return self.peak
        span = max(1, self.total_steps - self.warmup_steps - 1)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.decay == "linear":
            left = 1.0 - progress
        else:
            left = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.peak - self.min_lr) * left


__all__ = ["DECAYS", "LRSchedule", "ScheduleError"]
