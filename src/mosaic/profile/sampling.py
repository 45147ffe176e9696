"""Which (per-GPU batch, SM count) points to measure: smoothness-based sampling, pure and CPU-tested.

The full grid is every power-of-two per-GPU batch up to the global batch times every SM count a
green context can have. A coarse grid is measured first; then an interval between two measured
neighbours (along the SM axis at a measured batch, or along the batch axis at a measured SM
count) is bisected: its midpoint is measured and compared with the neighbours' interpolation,
and only where that interpolation misses by more than `tol` are both halves bisected again,
until the point budget is spent.

Interpolation follows the physics, so a smooth surface needs few points: along SMs the *rate*
1/T is linear in SMs (exact for compute-bound work, and for saturated work where it is flat);
along batches log T is linear in log b (exact for power laws).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

Point = tuple[int, int]
"""(per-GPU batch, SM count)."""

COARSE_SMS = (16, 32, 64, 96, 132)
"""96: plans cap a colocated module at 64-128 SMs, and without a green-context point there the
law reached 132 (a plain stream) from 64 alone: when the profiling budget ended before
refinement (ImageBind's compiled surfaces, 2026-12-02), it put the audio encoder at b128 on
104 SMs at 37.4 ms where rate-linear interpolation of its 64 and 132 points gives 40.3, and
colocations at b128 realised 8% of the saving predicted from such rows."""
LOW_SMS = 8
"""Measured at the small batches only: the low end of the SM axis, where big modules are slow."""


def batch_grid(global_batch: int, max_batch: int | None = None) -> list[int]:
    """Powers of two up to `max_batch` (default: the global batch), plus both themselves."""
    top = max(global_batch, max_batch or global_batch)
    grid = [1 << i for i in range(top.bit_length()) if (1 << i) <= top]
    return sorted(set(grid) | {global_batch, top})


def _nearest(values: Sequence[int], target: int) -> int:
    return min(values, key=lambda v: (abs(v - target), v))


def coarse_points(batches: Sequence[int], sms: Sequence[int],
                  coarse_sms: Sequence[int] = COARSE_SMS, anchor: int | None = None) -> list[Point]:
    """{min, mid, max} batches x the coarse SM counts, plus the lowest SM count at small
    batches. `anchor`: a batch measured too when the grid holds it (the preset's own, where
    plans run; with the grid going to 4x it, it is neither mid nor max)."""
    mid = batches[len(batches) // 2]
    rows = sorted({batches[0], mid, batches[-1]} | ({anchor} & set(batches)))
    cols = sorted({_nearest(sms, k) for k in coarse_sms})
    pts = [(b, k) for b in rows for k in cols]
    low = _nearest(sms, LOW_SMS)
    pts += [(b, low) for b in sorted({batches[0], mid}) if (b, low) not in pts]
    return pts


def _interp_k(k0: int, t0: float, k1: int, t1: float, k: int) -> float:
    w = (k - k0) / (k1 - k0)
    return 1.0 / ((1 - w) / t0 + w / t1)


def _interp_b(b0: int, t0: float, b1: int, t1: float, b: int) -> float:
    w = (math.log(b) - math.log(b0)) / (math.log(b1) - math.log(b0))
    return math.exp((1 - w) * math.log(t0) + w * math.log(t1))


def _intervals(measured: dict[Point, float], batches: Sequence[int],
               sms: Sequence[int]) -> list[tuple[str, int, int, int]]:
    """(axis, fixed value, lo index, hi index) between adjacent measured points, gap >= 2."""
    out = []
    for axis, fixed_vals, grid in (("k", batches, sms), ("b", sms, batches)):
        for fixed in fixed_vals:
            idx = [i for i, v in enumerate(grid)
                   if ((fixed, v) if axis == "k" else (v, fixed)) in measured]
            out += [(axis, fixed, lo, hi) for lo, hi in zip(idx, idx[1:], strict=False)
                    if hi - lo >= 2]
    return out


def refine(measure: Callable[[int, int], float], measured: dict[Point, float],
           batches: Sequence[int], sms: Sequence[int], *, tol: float = 0.05,
           budget: int = 8) -> list[Point]:
    """Bisect where interpolation of neighbours mispredicts a midpoint by > tol.

    `measured` (point -> seconds) is extended in place; returns the points added, in order.
    Wider intervals go first, so a small budget is spent where the grid is coarsest.
    """
    heap = [(-(hi - lo), axis, fixed, lo, hi) for axis, fixed, lo, hi in _intervals(measured, batches, sms)]
    heapq.heapify(heap)
    added: list[Point] = []
    while heap and len(added) < budget:
        _, axis, fixed, lo, hi = heapq.heappop(heap)
        mid = (lo + hi) // 2
        grid = sms if axis == "k" else batches
        pt = (fixed, grid[mid]) if axis == "k" else (grid[mid], fixed)
        ends = [(fixed, grid[i]) if axis == "k" else (grid[i], fixed) for i in (lo, hi)]
        if pt in measured:
            t = measured[pt]
        else:
            t = measured[pt] = measure(*pt)
            added.append(pt)
        interp = _interp_k if axis == "k" else _interp_b
        guess = interp(grid[lo], measured[ends[0]], grid[hi], measured[ends[1]], grid[mid])
        if abs(guess / t - 1.0) > tol:
            for a, z in ((lo, mid), (mid, hi)):
                if z - a >= 2:
                    heapq.heappush(heap, (-(z - a), axis, fixed, a, z))
    return added
