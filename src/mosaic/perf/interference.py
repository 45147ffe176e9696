"""Interference model: how colocated modules share SMs and slow each other, fitted to measurements.

Each module of a group (a `CoWork`) brings its measured time curve T(k) over SM counts, its
limit (quota, cap or whole GPU), and its bandwidth demand d(k) = (analytic bytes moved) /
(device bandwidth) / T(k): the fraction of the device's bandwidth it uses alone on k SMs. The
byte count is the analytic model's (weights, grads and AdamW state once per step, activations
three passes). Where the profiler measured a module next to a memory-streaming antagonist,
its *sensitivity* v (slowdown - 1 next to a saturating streamer) replaces d as the victim term.

Group time is a fluid simulation (phases end when a module finishes; SMs are re-split):
- `partition`: fixed disjoint quotas.
- `free`: (1 + overlap) x the SMs (co-residency) split by weight sat_i**zeta (sat_i: SMs the module can use, 5% from its best),
  times (1 + prio_boost) for a high-priority stream, water-filled so none gets more than sat_i.
- `cap`: a capped module shares its cap region with the uncapped ones and gets cap_share of it;
  uncapped modules split what is left as in `free`.
- `temporal`: sum of whole-GPU times.
Per phase, module i's rate is divided by its slowdown from bandwidth contention with the other
active modules (three variants, for the planner ablation):
- `unaware`: s_i = 1
- `linear`:  s_i = 1 + alpha * sum_{j != i} d_j
- `aware`:   s_i = 1 + alpha * v_i**p * (sum_{j != i} d_j)**q      (the paper's Eq. 8 role)
Then, where every module of the phase has a measured busy fraction beta_i (the share of the
whole GPU it keeps busy alone at its batch: two copies side by side over twice one alone), the
phase may not do more than one GPU's worth of busy work: if sum_i rate_i * beta_i * T_i(full)
exceeds 1, every rate is divided by that sum; and the group, its stream-overhead stretch
included, ends no sooner than sum_i beta_i * T_i(full). A green-context surface makes a module on k SMs
do more per SM than on the whole GPU (caches and bandwidth to itself), which neighbours that
fill the GPU take back: ImageBind's encoders side by side at b128 ran in the time they take
one after another (traced, 2026-12-02), where the allocation alone predicted 12% less.
The group time is stretched by (1 + kappa * (n - 1)) for stream overheads. Pure Python on
small lists: the fit evaluates it thousands of times.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from scipy.optimize import least_squares

from mosaic.errors import MosaicError
from mosaic.graph import ModuleSpec

VARIANTS = ("aware", "unaware", "linear")
SATURATION = 1.05
"""A module saturates at the fewest SMs within 5% of its time on all the SMs it may use."""


class InterferenceError(MosaicError):
    """Bad interference-model input; the message names the field and the fix."""


def module_bytes(spec: ModuleSpec, per_gpu_batch: int) -> float:
    """Device-memory bytes of one forward + backward + optimizer step (the analytic count)."""
    return spec.step_traffic_bytes(per_gpu_batch)


@dataclass(frozen=True, slots=True)
class CoWork:
    """One module inside a colocated group, as the interference model sees it."""

    sms: tuple[float, ...]
    """SM counts of the curve, ascending; the last is the whole GPU."""
    times: tuple[float, ...]
    """Seconds alone on each SM count (non-increasing)."""
    limit: float
    """Quota (partition), cap (cap), or the whole GPU (free)."""
    memory_s: float
    """Analytic bytes over device bandwidth: seconds if memory were the only cost."""
    sensitivity: float | None = None
    """Slowdown - 1 next to a bandwidth-saturating antagonist (None: use the demand)."""
    priority: int = 0
    busy: float | None = None
    """Fraction of the whole GPU the module keeps busy alone on it at this batch (measured,
    db.BusyPoint); None: not measured, and a phase it runs in is not bounded."""
    sat: float = field(init=False)

    def __post_init__(self) -> None:
        best = self.time_at(self.limit)
        sat = next((k for k, t in zip(self.sms, self.times, strict=True)
                    if k <= self.limit and t <= SATURATION * best), self.limit)
        object.__setattr__(self, "sat", float(sat))

    def time_at(self, k: float) -> float:
        """Alone on k SMs: the rate 1/T is interpolated linearly in k (zero at zero SMs)."""
        sms, times = self.sms, self.times
        if k >= sms[-1]:
            return times[-1]
        if k <= sms[0]:
            return times[0] * sms[0] / max(k, 1e-3)
        i = bisect.bisect_left(sms, k)
        w = (k - sms[i - 1]) / (sms[i] - sms[i - 1])
        return 1.0 / ((1 - w) / times[i - 1] + w / times[i])

    @property
    def alone_s(self) -> float:
        return self.time_at(self.limit)

    @property
    def full_s(self) -> float:
        return self.times[-1]

    def demand(self, k: float) -> float:
        return min(1.0, self.memory_s / self.time_at(k))


@dataclass(frozen=True, kw_only=True, slots=True)
class InterferenceParams:
    variant: str = "aware"
    alpha: float = 0.0
    p: float = 1.0
    q: float = 1.0
    zeta: float = 0.5
    """Free sharing splits SMs by saturation**zeta (0: equally, 1: by what each can use)."""
    prio_boost: float = 1.0
    """Extra weight of a high-priority stream in the split."""
    cap_share: float = 0.5
    """Fraction of its cap region a capped module gets next to uncapped ones."""
    overlap: float = 0.0
    """Co-residency: concurrent kernels share an SM's idle issue slots, so free and cap
    sharing split (1 + overlap) x the GPU's SMs (none gets more than it can use)."""
    kappa: float = 0.0
    busy_bound: bool = True
    """Bound each phase by one GPU's worth of busy work where the busy fractions are known."""
    fitted_on: int = 0
    """Colocations the coefficients were fitted to (0: defaults)."""
    train_mape: float | None = None

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise InterferenceError(f"interference={self.variant!r}: choose one of {VARIANTS}")


def slowdowns(params: InterferenceParams, works: Sequence[CoWork], sms: Sequence[float]) -> list[float]:
    """Bandwidth slowdown of each module while all of `works` run on `sms` SMs each."""
    if params.variant == "unaware" or len(works) < 2:
        return [1.0] * len(works)
    d = [w.demand(k) for w, k in zip(works, sms, strict=True)]
    total = sum(d)
    if params.variant == "linear":
        return [1.0 + params.alpha * (total - di) for di in d]
    return [1.0 + params.alpha * (w.sensitivity if w.sensitivity is not None else di) ** params.p
            * max(total - di, 0.0) ** params.q for w, di in zip(works, d, strict=True)]


def _waterfill(total: float, weights: list[float], caps: list[float]) -> list[float]:
    """Split `total` by weight, none above its cap; what a capped one leaves goes to the rest."""
    out = [0.0] * len(weights)
    free = list(range(len(weights)))
    while free and total > 1e-9:
        wsum = sum(weights[i] for i in free) or 1.0
        over = [i for i in free if total * weights[i] / wsum >= caps[i] - out[i]]
        if not over:
            for i in free:
                out[i] += total * weights[i] / wsum
            return out
        for i in over:
            total -= caps[i] - out[i]
            out[i] = caps[i]
            free.remove(i)
    return out


def _allocate(params: InterferenceParams, works: Sequence[CoWork], sharing: str,
              full: float) -> list[float]:
    if sharing == "partition":
        return [w.limit for w in works]
    capped = [i for i, w in enumerate(works) if sharing == "cap" and w.limit < full]
    full = full * (1.0 + params.overlap)
    weights = [w.sat ** params.zeta * (1.0 + params.prio_boost * w.priority) for w in works]
    if not capped or len(capped) == len(works):
        return _waterfill(full, weights, [w.sat for w in works])
    scale = min(1.0, full / sum(works[i].limit for i in capped))  # overlapping caps
    out = [0.0] * len(works)
    for i in capped:
        out[i] = min(works[i].sat, params.cap_share * works[i].limit * scale)
    rest = [i for i in range(len(works)) if i not in capped]
    share = _waterfill(full - sum(out), [weights[i] for i in rest], [works[i].sat for i in rest])
    for i, k in zip(rest, share, strict=True):
        out[i] = k
    return out


def finish_times_s(params: InterferenceParams, works: Sequence[CoWork], sharing: str) -> list[float]:
    """Each module's finish time in the group (a fluid simulation of phases)."""
    if sharing == "temporal" or len(works) == 1:
        ends, t = [], 0.0
        for w in works:
            t += w.full_s if sharing == "temporal" else w.alone_s
            ends.append(t)
        return ends
    full = works[0].sms[-1]
    progress = [0.0] * len(works)
    ends = [0.0] * len(works)
    active = list(range(len(works)))
    t = 0.0
    while active:
        group = [works[i] for i in active]
        sms = _allocate(params, group, sharing, full)
        slow = slowdowns(params, group, sms)
        rates = [1.0 / (w.time_at(max(k, 1e-3)) * s) for w, k, s in zip(group, sms, slow, strict=True)]
        if params.busy_bound:
            rates = within_capacity(group, rates)
        dt = min((1.0 - progress[i]) / r for i, r in zip(active, rates, strict=True))
        t += dt
        for i, r in zip(list(active), rates, strict=True):
            progress[i] += r * dt
            if progress[i] >= 1.0 - 1e-9:
                ends[i] = t
                active.remove(i)
    stretch = 1.0 + params.kappa * (len(works) - 1)
    ends = [e * stretch for e in ends]
    floor = busy_work_s(works) if params.busy_bound else 0.0
    # A fitted stretch below 1 (kappa < 0) must not beat the GPU's capacity either.
    return ends if floor <= max(ends) else [e * floor / max(ends) for e in ends]


def busy_work_s(works: Sequence[CoWork]) -> float:
    """Seconds of one whole GPU kept busy by the works one after another (0 where a busy
    fraction is unknown): no colocation of them ends sooner."""
    if any(w.busy is None for w in works):
        return 0.0
    return sum(w.busy * w.full_s for w in works)


def within_capacity(works: Sequence[CoWork], rates: list[float]) -> list[float]:
    """`rates` slowed alike so that the works together keep at most one whole GPU busy
    (sum of rate x busy fraction x whole-GPU time <= 1); unchanged where a busy fraction
    is unknown."""
    if len(works) < 2 or any(w.busy is None for w in works):
        return rates
    load = sum(r * w.busy * w.full_s for w, r in zip(works, rates, strict=True))
    return rates if load <= 1.0 else [r / load for r in rates]


def group_time_s(params: InterferenceParams, works: Sequence[CoWork], sharing: str) -> float:
    """Seconds until every module of the group is done."""
    return float(max(finish_times_s(params, works, sharing)))


# --- fitting -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CoSample:
    """A measured colocation: the group's works, mode, group time and per-module times."""

    works: tuple[CoWork, ...]
    sharing: str
    group_time_s: float
    module_times_s: tuple[float, ...] = ()


_FREE_NAMES = {
    "unaware": ("zeta", "prio_boost", "cap_share", "overlap", "kappa"),
    "linear": ("alpha", "zeta", "prio_boost", "cap_share", "overlap", "kappa"),
    "aware": ("alpha", "p", "q", "zeta", "prio_boost", "cap_share", "overlap", "kappa"),
}
_BOUNDS = {"alpha": (0.0, 20.0), "p": (0.2, 4.0), "q": (0.2, 4.0), "zeta": (0.0, 2.0),
           "prio_boost": (0.0, 10.0), "cap_share": (0.05, 1.0), "overlap": (0.0, 1.0),
           "kappa": (-0.05, 0.3)}


def _residuals(params: InterferenceParams, samples: Sequence[CoSample]) -> np.ndarray:
    """Log errors of group times and (half-weighted) of each module's finish time."""
    res = []
    for smp in samples:
        ends = finish_times_s(params, smp.works, smp.sharing)
        res.append(np.log(max(ends) / smp.group_time_s))
        if smp.module_times_s:
            res.extend(0.5 * np.log(np.array(ends) / np.array(smp.module_times_s)))
    return np.array(res)


def fit_interference(samples: Sequence[CoSample], variant: str = "aware") -> InterferenceParams:
    """Least-squares fit (log errors, soft-L1) of the variant's coefficients to measured groups."""
    base = InterferenceParams(variant=variant)
    samples = [s for s in samples if s.group_time_s > 0 and len(s.works) > 1]
    if not samples:
        return base
    names = _FREE_NAMES[variant]
    lo = np.array([_BOUNDS[n][0] for n in names])
    hi = np.array([_BOUNDS[n][1] for n in names])

    def build(x: np.ndarray) -> InterferenceParams:
        return replace(base, **dict(zip(names, map(float, x), strict=True)))

    best = None
    for start in _starts(variant):
        x0 = np.clip([start.get(n, getattr(base, n)) for n in names], lo + 1e-6, hi - 1e-6)
        sol = least_squares(lambda x: _residuals(build(x), samples), x0, bounds=(lo, hi),
                            loss="soft_l1", f_scale=0.05, max_nfev=60 * len(names),
                            diff_step=1e-3, x_scale="jac")
        if best is None or sol.cost < best.cost:
            best = sol
    params = build(best.x)
    errors = [abs(group_time_s(params, s.works, s.sharing) / s.group_time_s - 1) for s in samples]
    return replace(params, fitted_on=len(samples), train_mape=100.0 * float(np.mean(errors)))


def _starts(variant: str) -> list[dict[str, float]]:
    """Starting points: the allocation's min/clip make the cost surface rugged in cap_share
    and zeta, so each variant starts from a low and a high cap share."""
    sharing = [{"cap_share": 0.3, "zeta": 0.5}, {"cap_share": 0.7, "zeta": 1.0}]
    if variant == "unaware":
        return sharing
    if variant == "linear":
        return [{"alpha": 0.3, **s} for s in sharing]
    return [{"alpha": a, "p": p, "q": q, **s} for a, p, q in ((0.5, 1.0, 1.0), (2.0, 1.5, 2.0))
            for s in sharing]
