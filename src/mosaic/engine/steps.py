"""Training steps kept in flight: step k+1 is launched before the host reads step k's loss.

Why: reading a step's loss, or checking its gradients for NaN/inf, on the host waits until
the GPU has finished the step; the host then launches the optimizer and the next step while
the GPU idles. A torch.profiler trace of `mosaic train ofasys --preset paper` on the H200
found the GPU idle 13.4 of every 90 ms that way, and the trained step 15% slower than the
same plan in `mosaic bench`. Here the host launches step k+1 and only then waits for step k
(which the GPU has by then finished, with step k+1 queued behind it).

The non-finite guard stays exact. Each step's health (its loss summed over ranks, and per
module of the plan whether any gradient is NaN/inf) is computed and summed over ranks on
the device; a fused optimizer reads it as `found_inf` (as AMP's GradScaler uses it) and
applies no update, counts no step, for a step whose health is bad. The host learns of it
one step later and stops the run or logs the skip. An optimizer that cannot skip on the
device (SGD with momentum) is checked on the host before its update, as every step was
before.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mosaic.engine.rows import PINNING
from mosaic.engine.runner import StepOutput
from mosaic.engine.timer import Mark, Timer


@dataclass(slots=True)
class StepInFlight:
    """A launched step: what the host reads once the GPU has run it."""

    step: int
    start: Mark
    end: Mark
    health: torch.Tensor
    """On the host once `end` has passed: [loss summed over ranks, ranks asked to stop, loss
    not finite, then per module of `modules` 1.0 when some gradient of it is NaN/inf on some
    rank, then, when gradients are clipped, per module its share of the squared global
    gradient norm] (indices LOSS, STOP, BAD_LOSS, then the modules')."""
    modules: list[str]
    output: StepOutput
    clipped: bool = False


@dataclass(frozen=True, slots=True)
class StepResult:
    step: int
    loss: float
    seconds: float
    bad: list[str]
    """What was not finite: 'loss', "gradient of module 'x'"; the update was not applied."""
    output: StepOutput
    stop_requested: bool = False
    """Some rank had been asked to stop (SIGTERM) when it launched this step: every rank
    reads the same sum, so all stop after the same step."""
    grad_norm: float | None = None
    """The global gradient norm before clipping, when gradients are clipped."""


LOSS, STOP, BAD_LOSS = 0, 1, 2
"""Indices of a health vector (StepInFlight.health); the modules' flags follow BAD_LOSS."""


def skips_on_device(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether `optimizer` itself skips an update when told `found_inf` on the device, and
    divides the gradients it reads by a `grad_scale` it is told (AMP's GradScaler uses
    both): the fused AdamW (MainWeightsAdamW too) and the fused momentum-free SGD (fused SGD
    with momentum leaves its buffer uninitialised after a skipped first step: torch 2.13 on
    CPU). Over DTensor parameters too: a 0-d `found_inf` is replicated implicitly."""
    if optimizer is None or not all(g.get("fused") for g in optimizer.param_groups):
        return False
    return not (isinstance(optimizer, torch.optim.SGD)
                and any(g["momentum"] for g in optimizer.param_groups))


GUARDS = ("norms", "check")
"""How step_health finds a gradient NaN/inf. 'norms': a norm per gradient (reads 4 bytes per
parameter; the host launches work per gradient tensor: 15 ms a step for OFASys `paper`'s
1071 tensors on the CI machine's CPU). 'check': one fused check per module (AMP's
`_amp_foreach_non_finite_check_and_unscale_` at scale 1: 0.05 ms of host per module, but it
writes every gradient back, 8 bytes per parameter). The trainer starts with 'norms' and
switches to 'check' where the host is the bound (GuardChoice)."""


class GuardChoice:
    """Which guard the coming steps use: 'norms' until SAMPLES steps after the first SKIP
    (compile, capture) are timed; then 'check' for good when launching a step took at least
    HOST_BOUND of the step's time (the host is the bound, so its work per gradient tensor
    costs the GPU time), else 'norms' for good (the norms' host work hides under the GPU's)."""

    SKIP, SAMPLES, HOST_BOUND = 2, 3, 0.8

    def __init__(self) -> None:
        self.guard = "norms"
        self.decided = False
        self._samples: list[tuple[float, float]] = []

    def observe(self, launch_s: float, step_s: float) -> bool:
        """One read step: host seconds to launch it, its time. Whether the guard changed."""
        if self.decided:
            return False
        self._samples.append((launch_s, step_s))
        if len(self._samples) < self.SKIP + self.SAMPLES:
            return False
        used = self._samples[self.SKIP:]
        self.decided = True
        launch = statistics.median(x for x, _ in used)
        if launch >= self.HOST_BOUND * statistics.median(y for _, y in used):
            self.guard = "check"
            return True
        return False


@dataclass(frozen=True, slots=True)
class GradClip:
    """Clip the global gradient norm (over every module and rank) to `max_norm`, as
    torch.nn.utils.clip_grad_norm_ does over one model's parameters. `copies`: per module,
    for each of its gradient tensors, how many ranks hold the same values
    (PlanRunner.gradient_copies), so that summing each rank's squared norms over ranks counts
    every gradient element once."""

    max_norm: float
    copies: Callable[[str], list[int]]


def step_health(output: StepOutput, gradients: Callable[[str], list[torch.Tensor]],
                names: list[str], world_size: int, guard: str = "norms",
                stop_requested: bool = False, clip: GradClip | None = None) -> torch.Tensor:
    """[loss summed over ranks, ranks asked to stop, loss not finite, per name: some gradient
    not finite, and with `clip` per name its share of the squared global norm], on the
    device, summed over ranks there (a module may live on one rank; every rank must agree).
    The stop flag rides along: no collective of its own. With `clip` the norms it needs are
    the guard (one pass over the gradients serves both)."""
    loss = output.loss.detach().float().reshape(())
    stop = torch.full((), float(stop_requested), device=loss.device)
    parts = [loss, stop, (~torch.isfinite(loss)).float()]
    shares = []
    for name in names:  # a shard's local gradients: the flags are summed over ranks anyway
        grads = gradients(name)
        if not grads:
            parts.append(torch.zeros((), device=loss.device))
            shares.append(torch.zeros((), device=loss.device))
        elif clip is None:
            parts.append(_not_finite(grads, guard))
        else:
            share = _squared_norm_share(grads, clip.copies(name))
            parts.append((~torch.isfinite(share)).float())
            shares.append(share)
    health = torch.stack([p.to(loss.device) for p in parts + (shares if clip else [])])
    if world_size > 1:
        dist.all_reduce(health)
    return health


def _not_finite(grads: list[torch.Tensor], guard: str) -> torch.Tensor:
    """1.0 when some element of `grads` is NaN/inf (with 'norms' also when their norm
    overflows fp32: as unusable), else 0.0; on their device."""
    if guard == "check":
        return _some_element_not_finite(grads)
    return (~torch.isfinite(torch.stack(torch._foreach_norm(grads)).float().sum())).float()


AMP_CHECKED = (torch.float32, torch.float16)
"""Dtypes torch's AMP check has a CUDA kernel for (bf16 gradients of bf16 weights have none)."""


def _some_element_not_finite(grads: list[torch.Tensor]) -> torch.Tensor:
    """1.0 when some element is NaN/inf, in one multi-tensor kernel per kind: torch's AMP
    check for fp32/fp16 gradients, the largest magnitude for the others (a max cannot
    overflow, so a large finite gradient passes as it does the AMP check)."""
    found = torch.zeros((), device=grads[0].device)
    checked = [g for g in grads if g.dtype in AMP_CHECKED]
    others = [g for g in grads if g.dtype not in AMP_CHECKED]
    if checked:
        torch._amp_foreach_non_finite_check_and_unscale_(checked, found, torch.ones_like(found))
    if others:
        largest = torch.stack(torch._foreach_norm(others, float("inf"))).float()
        found = torch.maximum(found, (~torch.isfinite(largest)).any().float())
    return found


def may_capture(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` may capture a CUDA graph: MainWeightsAdamW captures its step
    once the gradients' addresses repeat, so until it holds a captured step or gave up (for an
    update under the backward, any module's optimizer)."""
    parts = getattr(optimizer, "optimizers", None)
    return any(getattr(o, "graphs", None) == {} and getattr(o, "capture_failed", "") is None
               for o in (parts.values() if parts else [optimizer]))


def step_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.step()`, with the row threads' pinning held off while it may capture
    (rows.PINNING says why); replaying a captured step waits for no pinning."""
    if may_capture(optimizer):
        with PINNING:
            optimizer.step()
    else:
        optimizer.step()


def launch_step(session: Any, optimizer: torch.optim.Optimizer | None, rows: list[dict],
                timer: Timer, step: int, poison: Any = None, guard: str = "norms",
                stop_requested: bool = False,
                clip: GradClip | None = None) -> tuple[StepInFlight, list[str] | None]:
    """Upload `rows`, run forward and backward, compute the step's health and launch the
    optimizer (told to skip on the device when the health is bad). Returns the step and, when
    the optimizer cannot skip on the device, what the host found not finite (the update was
    then not launched when there was any); None when the host has not looked yet.
    `stop_requested`: this rank was asked to stop (summed into the health with the others').
    `clip`: the gradients are scaled to the global norm's bound before the update."""
    start = timer.mark()
    data = session.to_device(rows)
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    output = session.step(data)
    if poison is not None:
        poison(session)
    names = sorted({p.module for s in session.plan.stages for p in s.placements})
    health = step_health(output, session.gradients, names, session.comm.world_size, guard,
                         stop_requested, clip)
    on_device = skips_on_device(optimizer)
    if clip is not None:
        divisor = _clip_divisor(health, len(names), clip.max_norm)
        if on_device:
            optimizer.grad_scale = divisor
        else:
            _divide_gradients(session, names, divisor)
    checked = None
    if on_device:
        optimizer.found_inf = (health[BAD_LOSS:BAD_LOSS + 1 + len(names)].sum() > 0).float()
        step_optimizer(optimizer)
    else:
        checked = read_bad(health.tolist(), names)
        if optimizer is not None and not checked:
            step_optimizer(optimizer)
    on_host = health.to("cpu", non_blocking=True) if health.is_cuda else health.clone()
    return StepInFlight(step=step, start=start, end=timer.mark(), health=on_host,
                        modules=names, output=output, clipped=clip is not None), checked


def _squared_norm_share(grads: list[torch.Tensor], copies: list[int]) -> torch.Tensor:
    """This rank's share of the squared global norm: each tensor's squared norm over the
    ranks that hold a copy of it. Grouped by dtype and copy count on the host: a foreach
    kernel takes one dtype, and torch runs a mixed list (bf16 weights' gradients beside
    fp32 biases') a tensor at a time, a launch each (Unified-IO 2 `paper`'s step took the
    host 94 ms instead of 45 on the H200). No weights go to the device every step (a
    host-to-device copy would wait for the GPU)."""
    groups: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
    for grad, count in zip(grads, copies, strict=True):
        groups.setdefault((grad.dtype, count), []).append(grad)
    return sum(torch.stack(torch._foreach_norm(group, 2, dtype=torch.float32)).square().sum()
               / count for (_, count), group in groups.items())


def _clip_divisor(health: torch.Tensor, modules: int, max_norm: float) -> torch.Tensor:
    """What to divide every gradient by so that the global norm is at most `max_norm`:
    max(1, norm / max_norm), clip_grad_norm_'s factor inverted (a fused optimizer divides
    by its `grad_scale`), on the device: the norm never goes to the host. A non-finite norm
    makes it non-finite; the guard skips that update."""
    norm = health[BAD_LOSS + 1 + modules:].sum().sqrt()
    return torch.clamp((norm + 1e-6) / max_norm, min=1.0)


def _divide_gradients(session: Any, names: list[str], divisor: torch.Tensor) -> None:
    """Divide every gradient by `divisor` in place, one foreach launch per dtype, for an
    optimizer that takes no `grad_scale` (one that does reads it in its own pass)."""
    for name in names:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in session.gradients(name):
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for grads in by_dtype.values():
            torch._foreach_div_(grads, divisor)


def finish_step(flight: StepInFlight, timer: Timer, since: Mark | None = None) -> StepResult:
    """Wait for `flight` and read it. `since`: the previous step's end when this step was
    launched right behind it, so that the GPU's time between the two (waiting for the host)
    counts in this step, as it counts in the run's wall-clock; else the step's own start."""
    seconds = timer.seconds(since or flight.start, flight.end)
    values = flight.health.tolist()
    shares = values[BAD_LOSS + 1 + len(flight.modules):]
    return StepResult(step=flight.step, loss=values[LOSS], seconds=seconds,
                      bad=read_bad(values, flight.modules), output=flight.output,
                      stop_requested=values[STOP] > 0,
                      grad_norm=math.sqrt(sum(shares)) if flight.clipped else None)


def read_bad(values: list[float], names: list[str]) -> list[str]:
    """The names of what a health vector (see StepInFlight.health) says was not finite."""
    bad = ["loss"] if values[BAD_LOSS] or not math.isfinite(values[LOSS]) else []
    flags = values[BAD_LOSS + 1:BAD_LOSS + 1 + len(names)]
    return bad + [f"gradient of module {n!r}" for n, f in zip(names, flags, strict=True) if f]
