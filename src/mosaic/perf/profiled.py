"""The profiled performance model: measured scaling surfaces + a fitted interference model.

Stages (vidur-style, each testable on its own):
1. `fit_surface`: per measured module, a parametric scaling law fitted by least squares,
       T(b, k) = t0 + c * b / k_eff,   k_eff = (k**-4 + (s0 * b**g)**-4) ** -1/4
   (latency t0; work c per sample spread over k SMs until the work can fill no more than
   s0 * b**g of them; the whole GPU, a plain stream, gets its own SM factor since it is
   measurably faster than the largest green context), plus a thin-plate RBF on the log
   residual in (log2 b, k). Queries are
   clamped to the measured box for the residual (the parametric part extrapolates), and the
   residual to its measured range: never NaN, never wild outside the hull.
2. `SurfaceSet`: all surfaces of a DB, the time rows over the GPU's SM grid (made monotone:
   more SMs never hurt), and the fallback for modules the DB lacks: the analytic model times
   measured / analytic of the measured points nearest in work and SM share, or one mean
   factor, whichever a leave-one-module-out test on the DB finds better (`AnalyticCalibration`:
   on the H200's compiled surfaces the ratio runs from about 0.3 for tiny kernels to about 1.1
   for mid-sized ones, and one factor was off by 46% for a median module, nearest points 19%).
3. `ProfiledModel`: the PerfModel, with the interference variant chosen by name. Its
   coefficients are the ones the profiling run stored in the DB's `fits` table beside their
   held-out error (benchmarks/profile_h200.py); a DB without them is fitted on load.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from scipy.interpolate import RBFInterpolator
from scipy.optimize import least_squares

from mosaic.graph import MMGraph, ModuleSpec
from mosaic.hardware import ClusterSpec, GPUSpec
from mosaic.perf.analytic import AnalyticModel
from mosaic.perf.base import ACCUMULATE_BYTES_PER_PARAM, PerfModel, Work, busiest_gpu_parts
from mosaic.perf.engine_term import (
    BF16_REDUCE,
    OVERLAPPED_SYNC,
    EngineTerm,
    bf16_moments,
    bf16_weights,
    kernels_of_engine,
    no_main_weights,
    per_weight_update,
    plan_features,
    sequential_plan,
    stored_term,
)
from mosaic.perf.interference import (
    CoSample,
    CoWork,
    InterferenceParams,
    fit_interference,
    group_time_s,
    module_bytes,
)
from mosaic.plan import Plan
from mosaic.profile.db import (
    COMM_KINDS,
    P2P_KINDS,
    BusyPoint,
    ColocPoint,
    FitRecord,
    ModulePoint,
    ProfileDB,
    ProfileDBError,
    colocation_kernels,
    comm_bus_factor,
    default_db_path,
    module_signature,
    stand_in_kernels,
)
from mosaic.profile.main_weights import (
    UpdatePoint,
    rounded_code_digest,
    stored_updates,
    update_code_digest,
)
from mosaic.profile.optimizer import OptimizerFit
from mosaic.profile.optimizer import stored_fit as stored_optimizer_fit

RHO = 4.0
"""Sharpness of the soft minimum between the SMs given and the SMs the work can fill."""
RBF_SMOOTHING = 1e-3
SURFACE_DRIFT = 0.25
"""A surface is suspect when it misses the alone times measured beside colocations by this
much (median over them); the surfaces of modules that match their code agree within ~8%."""
BUSY_RANGE = (0.5, 2.0)
"""Busy fractions used: two copies take at least one's time, and at most twice the
sequential time (a measurement outside is noise or a broken run)."""
MIN_KERNEL_COLOCATIONS = 12
"""Colocations of the engine's own kernels before their interference fit replaces the eager
one (a profiled model measures four groups per sharing mode at each batch it picks)."""


# --- 1. one module's surface ---------------------------------------------------------------
def _param_time(theta: np.ndarray, b: np.ndarray, k: np.ndarray, full: float) -> np.ndarray:
    t0, c, s0, g = np.exp(theta[0]), np.exp(theta[1]), np.exp(theta[2]), theta[3]
    # The whole GPU runs on a plain stream, measurably faster per SM than the largest green
    # context (H200: 120 -> 132 SMs gains up to 25%, not 10%): its own factor, theta[4].
    k = np.where(k >= full, k * np.exp(theta[4]), k)
    fill = s0 * b**g
    k_eff = (k ** -RHO + fill ** -RHO) ** (-1.0 / RHO)
    return t0 + c * b / k_eff


def monotone_row(raw: np.ndarray) -> np.ndarray:
    """Times over an increasing SM grid made non-increasing, anchored at the whole GPU (the
    last column): the profiler measures the whole GPU at every batch it samples, while a
    column between its sampled SM counts is the law's extrapolation, and that can dip below
    the whole GPU's time (ImageBind's compiled audio encoder at b32: 8.95 ms at 128 SMs under
    9.53 on the whole GPU, where the engine measured 10.57). Taking running minima from the
    low end would pull the whole GPU down to the dip; raising the dip to the whole GPU's time
    keeps the measured end."""
    return np.minimum.accumulate(np.maximum(raw, raw[-1]))


@dataclass(frozen=True, slots=True)
class Surface:
    """T(b, k) of one module: parametric law x exp(clamped RBF residual)."""

    theta: np.ndarray
    box: tuple[float, float, float, float]
    """(log2 b min, log2 b max, k min, k max) of the measured points."""
    residual: Any
    """RBFInterpolator on normalised coordinates, or None (too few points)."""
    residual_range: tuple[float, float]
    n_points: int
    full_sms: float

    def _unit(self, b: np.ndarray, k: np.ndarray) -> np.ndarray:
        lb0, lb1, k0, k1 = self.box
        u = (np.clip(np.log2(b), lb0, lb1) - lb0) / max(lb1 - lb0, 1e-9)
        v = (np.clip(k, k0, k1) - k0) / max(k1 - k0, 1e-9)
        return np.column_stack([u, v])

    def predict(self, b: Any, k: Any) -> np.ndarray:
        b = np.atleast_1d(np.asarray(b, dtype=float))
        k = np.atleast_1d(np.asarray(k, dtype=float))
        b, k = np.broadcast_arrays(b, k)
        base = _param_time(self.theta, b, k, self.full_sms)
        if self.residual is None:
            return base * np.exp(self.residual_range[0])
        r = np.clip(self.residual(self._unit(b, k)), *self.residual_range)
        return base * np.exp(r)


_LO = np.array([-40.0, -60.0, np.log(1.0), 0.0, np.log(0.7)])
_HI = np.array([5.0, 5.0, np.log(1e5), 2.0, np.log(2.0)])


def _fit_theta(b: np.ndarray, k: np.ndarray, t: np.ndarray, full: float) -> np.ndarray:
    t0 = 0.5 * t.min()
    heavy = np.argmax(b / k)
    c = max(t[heavy] - t0, 1e-3 * t[heavy]) * k[heavy] / b[heavy]
    if len(t) >= 6 and len(np.unique(b)) >= 2 and len(np.unique(k)) >= 2:
        fit = [0, 1, 2, 3] + ([4] if (k >= full).any() and (k < full).any() else [])
    else:  # too few points for the whole law: latency and work only
        fit = [0, 1]
    best = None
    for g0, s_mid in ((0.5, 48.0), (1.0, 96.0), (0.2, 24.0)):
        x0 = np.clip([np.log(t0), np.log(c), np.log(s_mid / np.median(b) ** g0), g0, 0.0],
                     _LO + 1e-6, _HI - 1e-6)

        def resid(x: np.ndarray, x0: np.ndarray = x0) -> np.ndarray:
            theta = x0.copy()
            theta[fit] = x
            return np.log(_param_time(theta, b, k, full) / t)

        sol = least_squares(resid, x0[fit], bounds=(_LO[fit], _HI[fit]), loss="soft_l1",
                            f_scale=0.05)
        if best is None or sol.cost < best[0]:
            theta = x0.copy()
            theta[fit] = sol.x
            best = (sol.cost, theta)
    return best[1]


SURFACE_FITS = "surfaces"
"""The `fits` record holding every surface's law parameters, keyed by surface_fit_key."""


def fit_surface(points: Sequence[ModulePoint], full_sms: float | None = None,
                stored: Mapping[str, Sequence[float]] | None = None) -> Surface:
    """Fit one module's scaling surface to its measured (batch, SMs, time) points.

    `full_sms`: the GPU's SM count (the plain-stream column); default the most SMs measured.
    `stored`: law parameters by surface_fit_key, as `mosaic profile` stored them; where
    these points' key is there, they are used instead of fitting.
    """
    if not points:
        raise ValueError("fit_surface: no points; profile the module first")
    measured = _measured(points)
    full = float(full_sms or max(k for _, k, _ in measured))
    theta = (stored or {}).get(surface_fit_key(measured, full))
    return _fitted(measured, full, tuple(theta) if theta is not None else None)


def _measured(points: Sequence[ModulePoint]) -> tuple[tuple[float, float, float], ...]:
    """(batch, SMs, seconds) of each point: what a surface is a function of."""
    return tuple((float(p.per_gpu_batch), float(p.num_sms), float(p.time_s)) for p in points)


def surface_fit_key(measured: tuple[tuple[float, float, float], ...], full: float) -> str:
    """The points a surface is fitted on, as a short digest (exact: floats' repr round-trips)."""
    return hashlib.sha1(repr((measured, full)).encode()).hexdigest()[:16]


@lru_cache(maxsize=1024)
def _fitted(measured: tuple[tuple[float, float, float], ...], full: float,
            theta: tuple[float, ...] | None = None) -> Surface:
    """The surface of (batch, SMs, seconds) points: a pure function of them, so fitted once a
    process. One accuracy gate or BENCHMARKS.md render loads a model per engine kind, GPU
    count and accumulation (44 of them), and each fitted the same surfaces again (least
    squares from three starts: 85% of the render's time). With `theta` (a stored fit) the
    law is not fitted: least squares stops at slightly different points on other numpy and
    scipy builds, and the planners' searches amplify that into other plans, so a profile's
    predictions are the same on every machine only with its fits stored."""
    b, k, t = (np.array(column) for column in zip(*measured, strict=True))
    theta = np.array(theta) if theta is not None else _fit_theta(b, k, t, full)
    resid = np.log(t / _param_time(theta, b, k, full))
    box = (float(np.log2(b.min())), float(np.log2(b.max())), float(k.min()), float(k.max()))
    surface = Surface(theta, box, None, (float(np.mean(resid)),) * 2, len(t), full)
    if len(t) >= 4 and len(np.unique(b)) >= 2 and len(np.unique(k)) >= 2:
        rbf = RBFInterpolator(surface._unit(b, k), resid, kernel="thin_plate_spline",
                              smoothing=RBF_SMOOTHING)
        surface = Surface(theta, box, rbf, (float(resid.min()), float(resid.max())), len(t), full)
    return surface


# --- 2. every module of a DB ---------------------------------------------------------------
FALLBACK_NEIGHBOURS = 15
FALLBACK_SHARE_WEIGHT = 3.0
"""The nearest-points neighbourhood: 15 measured points, nearest in log(analytic time) and
in SM share weighted 3x (chosen among 5/15/30 neighbours and weights 0/1/3 by
leave-one-module-out error on the shipped H200 compiled points)."""

CalibrationPoint = tuple[float, float, float]
"""(analytic_s, sm_share, measured_s) of one measured point."""


@dataclass(frozen=True)
class AnalyticCalibration:
    """measured / analytic for a module with no surface. `nearest`: the median log ratio of
    the measured points nearest in log analytic time and SM share (queries beyond the
    measured work clamped to its range); else one factor, the geometric mean over all points.
    With no points the factor is 1."""

    log_analytic: np.ndarray
    share: np.ndarray
    log_ratio: np.ndarray
    nearest: bool = True
    held_out: dict[str, float] | None = None
    """Leave-one-module-out median module |error| (%) of each way, when chosen by it."""

    @classmethod
    def of(cls, points: Sequence[CalibrationPoint], nearest: bool = True) -> AnalyticCalibration:
        a = np.array([[np.log(t), k, np.log(m / t)] for t, k, m in points
                      if t > 0 and m > 0]).reshape(-1, 3)  # a zero would make the log -inf
        return cls(a[:, 0], a[:, 1], a[:, 2], nearest)

    @classmethod
    def chosen(cls, by_module: Mapping[str, Sequence[CalibrationPoint]]) -> AnalyticCalibration:
        """The way with the lower leave-one-module-out median error on these modules (the
        nearest points won on compiled H200 surfaces, 19% against 46%, one factor on eager
        ones, 34% against 41%)."""
        held = held_out_errors(by_module)
        points = [p for ps in by_module.values() for p in ps]
        if not held:
            return cls.of(points)
        scores = {how: float(np.median([e[how] for e in held.values()]))
                  for how in ("nearest", "global")}
        return replace(cls.of(points, nearest=scores["nearest"] <= scores["global"]),
                       held_out=scores)

    @property
    def mean(self) -> float:
        return float(np.exp(self.log_ratio.mean())) if len(self.log_ratio) else 1.0

    def factor(self, analytic_s: float, sm_share: float) -> float:
        if not len(self.log_ratio):
            return 1.0
        if not self.nearest:
            return self.mean
        x = float(np.clip(np.log(analytic_s), self.log_analytic.min(), self.log_analytic.max()))
        d = np.hypot(self.log_analytic - x, FALLBACK_SHARE_WEIGHT * (self.share - sm_share))
        closest = np.argsort(d, kind="stable")[:FALLBACK_NEIGHBOURS]
        return float(np.exp(np.median(self.log_ratio[closest])))

    def describe(self) -> str:
        way = (f"the {FALLBACK_NEIGHBOURS} nearest measured points' ratio" if self.nearest
               else f"{self.mean:.3g} (mean ratio)")
        if self.held_out is None:
            return f"analytic x {way}"
        return (f"analytic x {way}, held-out median module error {self.held_out['nearest']:.0f}% "
                f"nearest / {self.held_out['global']:.0f}% one factor")


def held_out_errors(by_module: Mapping[str, Sequence[CalibrationPoint]]
                    ) -> dict[str, dict[str, float]]:
    """Per module, the median |error| (%) of its points predicted by each way calibrated on
    the other modules alone."""
    out = {}
    for sig, own in by_module.items():
        rest = [p for other, ps in by_module.items() if other != sig for p in ps]
        if not own or not rest:
            continue
        errors = {}
        for how, calibration in (("nearest", AnalyticCalibration.of(rest)),
                                 ("global", AnalyticCalibration.of(rest, nearest=False))):
            errors[how] = 100 * float(np.median([abs(a * calibration.factor(a, k) / m - 1)
                                                 for a, k, m in own]))
        out[sig] = errors
    return out


def sm_grid(gpu: GPUSpec) -> np.ndarray:
    """SM counts a green context can have: multiples of the granularity, plus the whole GPU."""
    grid = list(range(gpu.sm_granularity, gpu.num_sms + 1, gpu.sm_granularity))
    return np.array(sorted(set(grid) | {gpu.num_sms}), dtype=float)


class LazySurfaces(Mapping[str, Surface]):
    """Signature -> Surface, each fitted on first use. A plan touches a few of the DB's modules,
    and fitting all of them up front (least squares from three starts each) cost over a second
    of every `mosaic plan`; membership and len answer from the points, without fitting."""

    def __init__(self, points: dict[str, list[ModulePoint]], full_sms: float,
                 stored: Mapping[str, Sequence[float]] | None = None) -> None:
        self._points = {sig: pts for sig, pts in points.items() if pts}
        self._full_sms = full_sms
        self.stored = stored or {}
        self._fitted: dict[str, Surface] = {}

    def __getitem__(self, sig: str) -> Surface:
        if sig not in self._fitted:
            self._fitted[sig] = fit_surface(self._points[sig], self._full_sms, self.stored)
        return self._fitted[sig]

    def thetas(self) -> dict[str, list[float]]:
        """Every surface's law parameters by surface_fit_key (fitting those not fitted yet)."""
        return {self._key(sig): self[sig].theta.tolist() for sig in self._points}

    def stored_count(self) -> int:
        """Surfaces whose law comes from the stored fits rather than a fit on this machine."""
        return sum(self._key(sig) in self.stored for sig in self._points)

    def _key(self, sig: str) -> str:
        return surface_fit_key(_measured(self._points[sig]), float(self._full_sms))

    def __contains__(self, sig: object) -> bool:
        return sig in self._points

    def __iter__(self) -> Iterator[str]:
        return iter(self._points)

    def __len__(self) -> int:
        return len(self._points)


class SurfaceSet:
    """Scaling surfaces by module signature, with the calibrated analytic fallback."""

    def __init__(self, cluster: ClusterSpec, specs: dict[str, ModuleSpec],
                 points: dict[str, list[ModulePoint]], sensitivity: dict[str, float],
                 kernels: dict[str, str] | None = None, prefer: str = "eager",
                 busy: Sequence[BusyPoint] = (),
                 stored_fits: Mapping[str, Sequence[float]] | None = None) -> None:
        """`kernels`: signature -> the kernels it was profiled with (absent: eager); `prefer`:
        the kernels predictions are for. A module without a surface of those kernels uses
        its eager surface (the engine term absorbs the difference) and is counted in
        `fallbacks`. `busy`: measured busy fractions (interference.py's capacity bound)."""
        self.kernels = kernels or {}
        self.prefer = prefer
        self.fallbacks: set[str] = set()
        self.gpu = cluster.gpu
        self.grid = sm_grid(self.gpu)
        self.analytic = AnalyticModel(cluster)
        self.specs = specs
        self.points = points
        self.surfaces = LazySurfaces(points, self.gpu.num_sms, stored_fits)
        self.sensitivity = sensitivity
        # Modules without an antagonist run: the median sensitivity (None: none measured).
        self.default_sensitivity = float(np.median(list(sensitivity.values()))) if sensitivity else None
        self._rows: dict[tuple[ModuleSpec, int], np.ndarray] = {}
        self._match: dict[ModuleSpec, str | None] = {}
        self.rescaled: dict[str, float] = {}
        """signature -> factor its surface is scaled by (rescale_stale)."""
        self.busy: dict[str, list[tuple[int, float]]] = {}
        """signature -> [(per-GPU batch, busy fraction)], batches ascending."""
        for p in sorted(busy, key=lambda p: p.per_gpu_batch):
            self.busy.setdefault(p.signature, []).append((p.per_gpu_batch, p.fraction))

    @classmethod
    def from_db(cls, db: ProfileDB, cluster: ClusterSpec, prefer: str = "eager",
                stored_fits: bool = True) -> SurfaceSet:
        """`stored_fits`: use the law parameters `mosaic profile` stored (False: fit anew)."""
        records = db.modules()
        specs = {r.signature: r.spec for r in records}
        points: dict[str, list[ModulePoint]] = {}
        for p in db.points():
            points.setdefault(p.signature, []).append(p)
        fits = next((f.params for f in db.fits() if f.name == SURFACE_FITS), {})
        return cls(cluster, specs, points, _sensitivities(db),
                   kernels={r.signature: r.kernels for r in records}, prefer=prefer,
                   busy=db.busy(), stored_fits=fits.get("thetas", {}) if stored_fits else None)

    def kernels_of(self, sig: str | None) -> str:
        return self.kernels.get(sig, "eager")

    @cached_property
    def fallback(self) -> AnalyticCalibration:
        """The calibration of modules with no surface, from the measured points with a known
        spec (computed on first use: most plans need none)."""
        return AnalyticCalibration.chosen(self.calibration_points())

    @property
    def calibration(self) -> float:
        """The mean measured / analytic ratio."""
        return self.fallback.mean

    def calibration_points(self) -> dict[str, list[CalibrationPoint]]:
        """Per module signature, (analytic_s, sm_share, measured_s) of its measured points:
        modules with a known spec, of the preferred kernels where there are any."""
        sigs = [sig for sig in self.points if sig in self.specs]
        preferred = [sig for sig in sigs if self.kernels_of(sig) == self.prefer]
        return {sig: [(self._analytic_s(self.specs[sig], p.per_gpu_batch, p.num_sms),
                       p.num_sms / self.gpu.num_sms, p.time_s) for p in self.points[sig]]
                for sig in (preferred or sigs)}

    def _analytic_s(self, spec: ModuleSpec, b: int, k: float) -> float:
        return self.analytic.module_time_s(spec, b, k / self.gpu.num_sms)

    def signature_of(self, spec: ModuleSpec) -> str | None:
        """The preferred kernels' surface, else the first of its stand-ins that has one
        (`stand_in_kernels`); each by exact cost-fact match, else a module of the same shape
        within 2% (other torch)."""
        if spec not in self._match:
            sig = None
            for kernels in stand_in_kernels(self.prefer):
                sig = self._match_kernels(spec, kernels)
                if sig is not None:
                    if kernels != self.prefer:
                        self.fallbacks.add(spec.name)
                    break
            self._match[spec] = sig
        return self._match[spec]

    def _match_kernels(self, spec: ModuleSpec, kernels: str) -> str | None:
        sig = module_signature(spec, kernels)
        if sig in self.surfaces:
            return sig
        return next((s for s, other in self.specs.items() if s in self.surfaces
                     and self.kernels_of(s) == kernels and _close(spec, other)), None)

    def batch_range(self, spec: ModuleSpec) -> tuple[int, int] | None:
        """(smallest, largest) per-GPU batch measured for this module (None: not profiled)."""
        sig = self.signature_of(spec)
        if sig is None:
            return None
        batches = [p.per_gpu_batch for p in self.points[sig]]
        return min(batches), max(batches)

    def row(self, spec: ModuleSpec, per_gpu_batch: int, signature: str | None = None) -> np.ndarray:
        """Times over the SM grid, non-increasing (a quota can always be left partly idle);
        from `signature`'s surface where given and measured, else the preferred kernels'."""
        sig = signature if signature in self.surfaces else self.signature_of(spec)
        key = (sig or spec, per_gpu_batch)
        if key not in self._rows:
            if sig is None:
                raw = np.array([self.fallback_s(spec, per_gpu_batch, k) for k in self.grid])
            else:
                raw = self.surfaces[sig].predict(per_gpu_batch, self.grid)
                raw = raw * self.rescaled.get(sig, 1.0)
            self._rows[key] = monotone_row(raw)
        return self._rows[key]

    def fallback_s(self, spec: ModuleSpec, per_gpu_batch: int, num_sms: float) -> float:
        """The prediction for a module with no surface: analytic times the calibration."""
        analytic = self._analytic_s(spec, per_gpu_batch, num_sms)
        return analytic * self.fallback.factor(analytic, num_sms / self.gpu.num_sms)

    def time_s(self, spec: ModuleSpec, per_gpu_batch: int, num_sms: int) -> float:
        idx = int(np.searchsorted(self.grid, num_sms))
        return float(self.row(spec, per_gpu_batch)[min(idx, len(self.grid) - 1)])

    def busy_fraction(self, signature: str | None, per_gpu_batch: int) -> float | None:
        """The module's measured busy fraction at this batch: interpolated in log batch
        between measured batches, the nearest one's outside them; None where none was
        measured. Clipped to [BUSY_RANGE]: below half, two copies would beat one alone."""
        found = self.busy.get(signature or "")
        if not found:
            return None
        batches, fractions = zip(*found, strict=True)
        value = np.interp(np.log(per_gpu_batch), np.log(batches), fractions)
        return float(np.clip(value, *BUSY_RANGE))

    def cowork(self, spec: ModuleSpec, b: int, limit: int, priority: int = 0,
               alone_s: float = 0.0, signature: str | None = None) -> CoWork:
        """The interference model's view of a module on at most `limit` SMs; a measured
        `alone_s` (time alone on `limit`) rescales its curve to that measurement; `signature`:
        the surface of those kernels (a measured colocation's own), else the preferred one."""
        sig = signature if signature in self.surfaces else self.signature_of(spec)
        work = CoWork(sms=tuple(map(float, self.grid)),
                      times=tuple(map(float, self.row(spec, b, sig))),
                      limit=float(limit),
                      memory_s=module_bytes(spec, b) / self.gpu.mem_bandwidth_bps,
                      sensitivity=self.sensitivity.get(sig, self.default_sensitivity),
                      priority=priority, busy=self.busy_fraction(sig, b))
        if alone_s > 0:
            scale = alone_s / work.alone_s
            work = replace(work, times=tuple(t * scale for t in work.times))
        return work

    def sample(self, point: ColocPoint, use_measured_alone: bool = True) -> CoSample | None:
        """A measured colocation as a fitting sample (None if a module's spec is unknown)."""
        works = []
        for w in point.works:
            spec = self.specs.get(w.signature)
            if spec is None:
                return None
            alone = w.alone_s if use_measured_alone else 0.0
            works.append(self.cowork(spec, w.per_gpu_batch, w.num_sms, w.priority, alone,
                                     w.signature))
        times = tuple(w.time_s for w in point.works) if all(w.time_s > 0 for w in point.works) else ()
        return CoSample(tuple(works), point.sharing, point.group_time_s, times)

    def colocation_kernels(self, point: ColocPoint) -> str | None:
        """The kernels every member of a measured colocation ran (None: a mix)."""
        return colocation_kernels(point, self.kernels)

    def colocations_of(self, colocs: Sequence[ColocPoint], kernels: str) -> list[ColocPoint]:
        """The colocations whose every member ran `kernels`."""
        return [c for c in colocs if self.colocation_kernels(c) == kernels]

    def rescale_stale(self, colocs: Sequence[ColocPoint]) -> list[dict[str, Any]]:
        """Scale each drifting surface (drift) to the alone times measured beside the
        colocations, the newer measurement of the same module by the same method; returns
        the drift found. A stale surface is measured again with `--remeasure`; until then it
        predicts the module as it runs now rather than as it ran."""
        found = self.drift(colocs)
        for d in found:
            self.rescaled[d["signature"]] = 1.0 / d["surface_over_measured"]
        if found:
            self._rows.clear()
        return found

    def absorb_alone_times(self, colocs: Sequence[ColocPoint]) -> int:
        """Add each colocation member's alone time (measured on its own quota just before the
        colocation, the surfaces' method) as a point of its surface where the surface has none
        at that batch and SM count; several of one point: their median. Returns the points
        added. Colocations sit at the quotas plans use, 56-96 SMs where a budget-cut profile
        holds no green-context point: there the surfaces predicted ImageBind's compiled
        encoders up to 17% fast. Stale (rescaled) surfaces take none: their points and the alone
        times measure two versions of the module."""
        found: dict[tuple[str, int, int], list[float]] = {}
        for c in colocs:
            for w in c.works:
                if (w.alone_s > 0 and w.signature in self.surfaces
                        and w.signature not in self.rescaled):
                    found.setdefault((w.signature, w.per_gpu_batch, w.num_sms), []).append(w.alone_s)
        have = {(p.signature, p.per_gpu_batch, p.num_sms) for pts in self.points.values()
                for p in pts}
        added = 0
        points = {sig: list(pts) for sig, pts in self.points.items()}
        for (sig, b, k), times in sorted(found.items()):
            if (sig, b, k) not in have:
                points[sig].append(ModulePoint(signature=sig, per_gpu_batch=b, num_sms=k,
                                               time_s=float(np.median(times)),
                                               repeats=len(times), phase="colocation-alone"))
                added += 1
        if added:
            self.points = points
            self.surfaces = LazySurfaces(points, self.gpu.num_sms, self.surfaces.stored)
            self._rows.clear()
        return added

    def drift(self, colocs: Sequence[ColocPoint],
              tolerance: float = SURFACE_DRIFT) -> list[dict[str, Any]]:
        """Modules whose surface disagrees with the alone times measured beside the
        colocations (median surface / measured beyond `tolerance`): a surface older than the
        module's code, whose signature (its cost facts) did not change. ImageBind's compiled
        audio surface said twice the encoder's time after its attention mask was dropped
        (2026-12-02)."""
        ratios: dict[tuple[str, str, str], list[float]] = {}
        for c in colocs:
            sample = self.sample(c, use_measured_alone=False)
            if sample is None:
                continue
            for member, work in zip(c.works, sample.works, strict=True):
                if member.alone_s > 0:
                    key = (c.model, c.preset, member.module, member.signature)
                    ratios.setdefault(key, []).append(work.time_at(work.limit) / member.alone_s)
        drift = []
        for (model, preset, module, signature), found in sorted(ratios.items()):
            ratio = float(np.median(found))
            if abs(ratio - 1) > tolerance:
                drift.append({"model": model, "preset": preset, "module": module,
                              "signature": signature, "surface_over_measured": ratio,
                              "colocations": len(found)})
        return drift

    def interference_pool(self, colocs: Sequence[ColocPoint], choice: str | None = None
                          ) -> tuple[str, list[ColocPoint]]:
        """The colocations an interference fit for the preferred kernels uses, and their
        kernels: those `choice` names (the profiling run's held-out choice, stored), else the
        preferred kernels' own once there are MIN_KERNEL_COLOCATIONS, else the eager ones,
        else all."""
        by_kernels: dict[str | None, list[ColocPoint]] = {}
        for c in colocs:
            by_kernels.setdefault(self.colocation_kernels(c), []).append(c)
        if choice in (self.prefer, "eager") and by_kernels.get(choice):
            return choice, by_kernels[choice]
        if len(by_kernels.get(self.prefer, [])) >= MIN_KERNEL_COLOCATIONS:
            return self.prefer, by_kernels[self.prefer]
        if by_kernels.get("eager"):
            return "eager", by_kernels["eager"]
        return "mixed", list(colocs)


def _close(a: ModuleSpec, b: ModuleSpec) -> bool:
    same = (a.input_shape, a.num_layers, a.hidden_dim, a.tokens_per_sample) == (
        b.input_shape, b.num_layers, b.hidden_dim, b.tokens_per_sample)
    facts = ("num_params", "flops_per_sample", "activation_bytes_per_sample")
    return same and all(abs(getattr(a, f) - getattr(b, f)) <= 0.02 * max(getattr(b, f), 1.0)
                        for f in facts)


def _sensitivities(db: ProfileDB) -> dict[str, float]:
    """Slowdown - 1 of each module next to the memory-streaming antagonist."""
    return {s.signature: max(s.slowdown - 1.0, 0.0) for s in db.signatures() if s.alone_s > 0}


def surface_fits(db: ProfileDB, cluster: ClusterSpec) -> FitRecord:
    """Every surface a model of `db` fits, fitted anew: for each kernels label, the measured
    points and the points with the colocations' alone times absorbed (as ProfiledModel
    builds them), as one `fits` record for `db.add_fit`."""
    thetas: dict[str, list[float]] = {}
    colocations = db.colocations()
    for label in sorted({r.kernels for r in db.modules()}):
        surfaces = SurfaceSet.from_db(db, cluster, label, stored_fits=False)
        thetas.update(surfaces.surfaces.thetas())
        surfaces.rescale_stale(surfaces.colocations_of(colocations, label))
        if surfaces.absorb_alone_times(colocations):
            thetas.update(surfaces.surfaces.thetas())
    return FitRecord(name=SURFACE_FITS, params={"thetas": dict(sorted(thetas.items()))},
                     mape=None, n_points=len(thetas),
                     created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))


# --- 3. the PerfModel ----------------------------------------------------------------------
CAST_BYTES_PER_PARAM = 12.0
"""Device-memory traffic per weight of autocast's two casts a step: the forward's fp32 -> bf16
copy (read 4 bytes, write 2) and the backward's bf16 -> fp32 gradient (read 2, write 4)."""
BF16_ADD_BYTES = 6.0
"""Accumulating with bf16 weights, each micro-step's backward adds its bf16 gradient in place
(read 2 + 2, write 2)."""
FOLD_BYTES = 12.0
"""...and each micro-step but the last folds it into the fp32 sum and zeroes it (read 2 + 4,
write 4 + 2; main_weights.MicroStepGradients)."""
BF16_MOMENTS_SAVED_BYTES = 8.0
"""The update with bf16 moments reads and writes each of the two in 2 bytes, not 4: what a
module without a measured bf16-moment update is priced to save, at the optimizer's bandwidth."""
GATHER_CAST_SAVED_BYTES = 6.0
"""A sharded module gathered in bf16 (engine.fsdp.gather_dtype) skips autocast's forward cast
of each gathered weight (read 4 bytes, write 2); FSDP2 casts the GPU's own 1/d shard instead.
Its gradients are cast to fp32 either way (by autocast's backward, or FSDP's copy for the
reduce-scatter)."""
MAIN_WEIGHT_SAVED_BYTES = 6.0
"""The update without main weights neither reads nor writes a 4-byte fp32 copy but reads the
2-byte bf16 weight it writes (10 bytes a parameter become 4): what a module without a measured
such update is priced to save."""


class ProfiledModel(PerfModel):
    """Measured surfaces + interference (`aware` | `linear` | `unaware`) from a ProfileDB."""

    name = "profiled"
    optimizer_bytes_per_param = 28.0  # surfaces time forward + backward only

    def __init__(self, cluster: ClusterSpec, db: ProfileDB | str | Path | None = None, *,
                 interference: str = "aware", engine: str | None = None) -> None:
        """`engine`: the engine kind predictions are for (engine_term.engine_kind); its fitted
        engine term, when the DB has one, is added to every iteration. None: no engine term."""
        super().__init__(cluster)
        owned = not isinstance(db, ProfileDB)
        db = _open(db, cluster)
        try:
            self.db_path = db.path
            self.surfaces = SurfaceSet.from_db(db, cluster, kernels_of_engine(engine))
            fits = {f.name: f for f in db.fits()}
            self.stored_error = {name: f.mape for name, f in fits.items()}
            choice = fits.get(interference_choice_name(self.surfaces.prefer))
            self.interference_choice = choice.params if choice is not None else None
            colocations = db.colocations()
            self.interference_kernels, pool = self.surfaces.interference_pool(
                colocations, (self.interference_choice or {}).get("kernels"))
            self.stale = self.surfaces.rescale_stale(
                self.surfaces.colocations_of(colocations, self.surfaces.prefer))
            self.absorbed = self.surfaces.absorb_alone_times(colocations)
            fit_name = interference_fit_name(interference, self.interference_kernels)
            stored = _stored_params(fits.get(fit_name), interference)
            self.params: InterferenceParams = stored or fit_interference(
                [s for s in map(self.surfaces.sample, pool) if s is not None], interference)
            self.params_source = "stored fit" if stored else "fitted on load"
            self._comm = _comm_curves(db)
            self.engine = engine
            parts = (engine or "").split("+")
            self.sums_in_backward = OVERLAPPED_SYNC in parts
            if BF16_REDUCE in parts:
                self.grad_wire_bytes = 2.0
            self.engine_term: EngineTerm | None = stored_term(db, engine)
            self.optimizer_fit: OptimizerFit | None = stored_optimizer_fit(db)
            self.updates: dict[str, UpdatePoint] = stored_updates(db)
            self._update_specs = {sig: record.spec for record in db.modules()
                                  if (sig := module_signature(record.spec)) in self.updates}
        finally:
            if owned:
                db.close()

    @property
    def interference(self) -> str:
        return self.params.variant

    def describe(self) -> str:
        s = self.surfaces
        p = self.params
        coef = (f"alpha={p.alpha:.3g} p={p.p:.3g} q={p.q:.3g}" if p.variant == "aware"
                else f"alpha={p.alpha:.3g}" if p.variant == "linear" else "no slowdown term")
        fitted = (f"{self.params_source} on {p.fitted_on} {self.interference_kernels} colocations"
                  if p.fitted_on else "default coefficients")
        err = self.stored_error.get(interference_fit_name(p.variant, self.interference_kernels))
        err_s = f", held-out coloc MAPE {err:.1f}%" if err is not None else ""
        if self.interference_choice:  # compiled kernels: which colocations won, and by what
            c = self.interference_choice
            scores = ", ".join(f"{k.removesuffix('_mape')} {v:.1f}%" for k, v in c.items()
                               if k.endswith("_mape"))
            err_s += (f" (chosen by held-out error on the {c['own_colocations']} {s.prefer} "
                      f"colocations, held out by {c.get('held_out_by', 'fold')}, alone times "
                      f"as measured: {scores})")
        preferred = sum(1 for sig in s.surfaces if s.kernels.get(sig, "eager") == s.prefer)
        absorbed = (f", {self.absorbed} colocation alone times among their points"
                    if self.absorbed else "")
        stored = s.surfaces.stored_count()
        fits = ("all surface fits stored" if stored == len(s.surfaces) else
                f"{stored} of {len(s.surfaces)} surface fits stored, the rest fitted here")
        return (f"profiled ({self.db_path.name}: {preferred} measured {s.prefer} modules of "
                f"{len(s.surfaces)}{absorbed}, {fits}; "
                f"interference={p.variant} [{coef}], {fitted}{err_s}; modules not in the DB: "
                f"{s.fallback.describe()}; {self.comm_summary()}; {self._optimizer_summary()}; "
                f"{self._engine_summary()})")

    def coverage_notes(self, plan: Plan, graph: MMGraph) -> list[str]:
        """Where `plan`'s prediction leaves the measurements: a per-GPU batch outside a module's
        measured range (the surface extrapolates), a module with no surface of the engine's
        kernels (its eager one stands in) or none at all (calibrated analytic)."""
        notes = []
        for stage in plan.stages:
            for p in stage.placements:
                spec = graph.module(p.module)
                batch = graph.global_batch // p.dp_degree
                measured = self.surfaces.batch_range(spec)
                if measured is None:
                    notes.append(f"{p.module}: not profiled; {self.surfaces.fallback.describe()}")
                    continue
                if not measured[0] <= batch <= measured[1]:
                    notes.append(f"{p.module}: per-GPU batch {batch} is outside the measured "
                                 f"{measured[0]}..{measured[1]}; its time is extrapolated")
                if spec.name in self.surfaces.fallbacks:
                    used = self.surfaces.kernels_of(self.surfaces.signature_of(spec))
                    notes.append(f"{p.module}: no {self.surfaces.prefer} surface; the {used} "
                                 "one stands in")
        return notes + self._stale_notes(plan, graph) + self._update_notes(plan, graph)

    def _update_notes(self, plan: Plan, graph: MMGraph) -> list[str]:
        """With a per-weight update: the plan's modules whose update the DB has not measured."""
        if not per_weight_update(self.engine):
            return []
        placed = dict.fromkeys(p.module for stage in plan.stages for p in stage.placements)
        fix = (f"(measure it: mosaic profile {graph.name} --preset {graph.preset} --update "
               "--main-weights-only)")
        notes, code, rounded = [], update_code_digest(), rounded_code_digest()  # hash once
        no_main = no_main_weights(self.engine)
        for m in placed:
            point = self.update_of(graph.module(m))
            if point is None:
                notes.append(f"{m}: bf16 update a weight at a time not measured; priced as the "
                             f"flat one {fix}")
            elif point.code and point.code != code:
                notes.append(f"{m}: bf16 update measured with other update code "
                             f"(engine/main_weights.py has changed since) {fix}")
            elif no_main and point.rounded_code and point.rounded_code != rounded:
                notes.append(f"{m}: bf16 update without main weights measured with other "
                             f"update code (engine/rounded_weights.py has changed since) {fix}")
        return notes

    def _stale_notes(self, plan: Plan, graph: MMGraph) -> list[str]:
        """The plan's modules whose surface the colocations' alone times call stale."""
        placed = {p.module for stage in plan.stages for p in stage.placements}
        return [f"{d['module']}: scaled to its colocations, as {drift_finding(d, self.surfaces.prefer)}"
                for d in self.stale
                if (d["model"], d["preset"]) == (graph.name, graph.preset)
                and d["module"] in placed]

    def _optimizer_summary(self) -> str:
        fit = self.optimizer_fit
        if fit is None:
            return f"optimizer: {self.optimizer_bytes_per_param:g} B/param at the datasheet bandwidth"
        return f"optimizer: measured, {fit.fixed_s * 1e3:.2f} ms + {fit.s_per_param * 1e12:.2f} ps/param"

    def _engine_summary(self) -> str:
        if self.engine_term is not None:
            shared = self.engine_term.engine != self.engine
            return self.engine_term.describe() + (f", for {self.engine}" if shared else "")
        return (f"engine term: none fitted for {self.engine!r}" if self.engine
                else "engine term: none (no engine kind given)")

    def optimizer_step_s(self, num_params: float) -> float:
        """The measured optimizer step (profile/optimizer.py) where the DB holds one."""
        if self.optimizer_fit is None:
            return super().optimizer_step_s(num_params)
        return self.optimizer_fit.seconds(num_params)

    def memory_pass_s(self, num_params: float, bytes_per_param: float) -> float:
        """At the bandwidth the measured optimizer step reached over its bytes (a streaming
        pass over the parameters as it is), else the datasheet's."""
        fit = self.optimizer_fit
        if fit is None or fit.s_per_param <= 0:
            return super().memory_pass_s(num_params, bytes_per_param)
        return num_params * bytes_per_param / self.optimizer_bytes_per_param * fit.s_per_param

    # --- the engine term: added to the composed iteration, kept separable --------------------
    def composed_time_s(self, plan: Plan, graph: MMGraph) -> float:
        """The iteration composed from surfaces, transfers and optimizer, without the term.
        With bf16 weights, less the weight casts that the surfaces (measured with fp32 weights
        under autocast) include: a pass of CAST_BYTES_PER_PARAM over the busiest GPU's
        parameters at the optimizer's measured bandwidth (its own bytes barely change: reads
        a bf16 gradient, writes a bf16 weight). Accumulated, every micro-step skips the casts
        and adds bf16 gradients (BF16_ADD_BYTES) where fp32 weights add fp32 ones
        (ACCUMULATE_BYTES_PER_PARAM), and all but the last fold theirs into fp32 sums. With
        bf16 moments, less what they save (bf16_moments_saving_s). With fp32 weights, less
        the casts a sharded module's bf16 gather skips (gathered_bf16_saving_s)."""
        composed = super().iteration_time_s(plan, graph)
        if not bf16_weights(self.engine):
            return composed - self.gathered_bf16_saving_s(plan, graph)
        if per_weight_update(self.engine):
            composed += self.per_weight_extra_s(plan, graph)
        n = self.accumulation
        saved = n * CAST_BYTES_PER_PARAM
        if n > 1:
            saved += n * (ACCUMULATE_BYTES_PER_PARAM - BF16_ADD_BYTES) - (n - 1) * FOLD_BYTES
        composed -= self.memory_pass_s(self._most_params(plan, graph), saved)
        if bf16_moments(self.engine):
            composed -= self.bf16_moments_saving_s(plan, graph)
        if no_main_weights(self.engine):
            composed -= self.no_main_saving_s(plan, graph)
        return composed

    def gathered_bf16_saving_s(self, plan: Plan, graph: MMGraph) -> float:
        """Per stage, the most that one GPU saves of the forward casts its sharded modules'
        bf16 gathers skip (GATHER_CAST_SAVED_BYTES over the (1 - 1/d) of each module's
        weights that are not the GPU's own shard), each micro-step: the surfaces were
        measured with fp32 weights under autocast, casts included."""
        saving = 0.0
        for stage in plan.stages:
            by_gpu: dict[int, float] = {}
            for p in stage.placements:
                if p.shard:
                    skipped = graph.module(p.module).num_params * (1 - 1 / p.states_over)
                    for g in p.gpus:
                        by_gpu[g] = by_gpu.get(g, 0.0) + skipped
            if by_gpu:
                saving += self.memory_pass_s(max(by_gpu.values()), GATHER_CAST_SAVED_BYTES)
        return self.accumulation * saving

    def bf16_moments_saving_s(self, plan: Plan, graph: MMGraph) -> float:
        """What bf16 moments save the flat update on the GPU holding the most parameters: each
        module's measured flat update with fp32 less with bf16 moments (a per-weight plan's
        difference from the flat one is per_weight_extra_s, with bf16 moments where measured);
        a module not measured so, BF16_MOMENTS_SAVED_BYTES a parameter at the optimizer's
        bandwidth."""
        saving = 0.0
        for module, part in busiest_gpu_parts(plan, graph):
            spec = graph.module(module)
            point = self.update_of(spec)
            measured = point.bf16_moments_saving_s if point is not None else None
            saving += part * (measured if measured is not None else
                              self.memory_pass_s(spec.num_params, BF16_MOMENTS_SAVED_BYTES))
        return saving

    def no_main_saving_s(self, plan: Plan, graph: MMGraph) -> float:
        """What dropping the fp32 main weights saves the flat update on the GPU holding the most
        parameters: each module's measured flat update with bf16 moments less without main
        weights (profile/main_weights.py); with fp32 moments, or a module not measured so,
        MAIN_WEIGHT_SAVED_BYTES a bf16 parameter at the optimizer's bandwidth."""
        saving, moments = 0.0, bf16_moments(self.engine)
        for module, part in busiest_gpu_parts(plan, graph):
            spec = graph.module(module)
            point = self.update_of(spec)
            measured = point.no_main_saving_s if point is not None and moments else None
            saving += part * (measured if measured is not None else self.memory_pass_s(
                spec.bf16_weight_params or spec.num_params, MAIN_WEIGHT_SAVED_BYTES))
        return saving

    def per_weight_extra_s(self, plan: Plan, graph: MMGraph) -> float:
        """What updating bf16 weights a weight at a time adds over the flat layout on the GPU
        holding the most parameters: each module's measured difference (profile/main_weights.py;
        with bf16 moments where the engine keeps them and they were measured; 0 for a module
        not measured, which coverage_notes names)."""
        extra, moments, no_main = 0.0, bf16_moments(self.engine), no_main_weights(self.engine)
        for module, part in busiest_gpu_parts(plan, graph):
            point = self.update_of(graph.module(module))
            extra += (point.per_weight_extra_with(moments, no_main) * part
                      if point is not None else 0.0)
        return extra

    def update_of(self, spec: ModuleSpec) -> UpdatePoint | None:
        """The module's measured bf16 update: by its cost facts, else those of a profiled
        module of the same shape within 2% (other library versions count slightly other
        facts), as for surfaces."""
        exact = self.updates.get(module_signature(spec))
        if exact is not None:
            return exact
        return next((self.updates[sig] for sig, other in self._update_specs.items()
                     if _close(spec, other)), None)

    def engine_term_s(self, plan: Plan, graph: MMGraph) -> float:
        """The fitted per-step engine term of `plan` (0 without one for this engine kind)."""
        if self.engine_term is None:
            return 0.0
        return self._term_s(plan, graph, self.composed_time_s(plan, graph))

    def iteration_time_s(self, plan: Plan, graph: MMGraph) -> float:
        base = self.composed_time_s(plan, graph)
        if self.engine_term is None:
            return base
        return base + self._term_s(plan, graph, base)

    def _term_s(self, plan: Plan, graph: MMGraph, base: float) -> float:
        sequential = (self.composed_time_s(sequential_plan(plan), graph)
                      if "colocation_saving" in self.engine_term.features else None)
        return self.engine_term.seconds(plan_features(plan, graph, base, sequential))

    def module_time_s(self, module: ModuleSpec, per_gpu_batch: int, sm_share: float = 1.0) -> float:
        return self.surfaces.time_s(module, per_gpu_batch, self.cluster.gpu.round_sms(sm_share))

    def coworks(self, works: Sequence[Work], sharing: str) -> list[CoWork]:
        gpu = self.cluster.gpu
        return [self._tp_shard(w, self.surfaces.cowork(
            w.module, w.per_gpu_batch, gpu.num_sms if sharing == "free" else gpu.round_sms(w.sm_share),
            w.priority)) for w in works]

    def _tp_shard(self, w: Work, cowork: CoWork) -> CoWork:
        """A TP shard's curve: the replica's surface / t plus the TP all-reduces (work_time_s),
        and 1/t of its bytes."""
        t = w.tensor_parallel
        if t == 1:
            return cowork
        comm_s = self.tp_comm_s(w.module, w.per_gpu_batch, t)
        return replace(cowork, times=tuple(x / t + comm_s for x in cowork.times),
                       memory_s=cowork.memory_s / t)

    def colocated_time_s(self, works: Sequence[Work], sharing: str) -> float:
        if len(works) == 1 or sharing == "temporal":
            return sum(self.work_time_s(w, 1.0) for w in works)
        return group_time_s(self.params, self.coworks(works, sharing), sharing)

    # --- communication: measured curves, ring-scaled to other GPU counts, else analytic -------
    def allreduce_s(self, num_bytes: float, gpus: Sequence[int]) -> float:
        return self._comm_s("allreduce", num_bytes, list(gpus))[0]

    def collective_s(self, kind: str, num_bytes: float, gpus: Sequence[int]) -> float:
        """All-gather / reduce-scatter from the measured curves (sharded placements)."""
        return self._comm_s(kind, num_bytes, list(gpus))[0]

    def transfer_s(self, num_bytes: float, src_gpus: Sequence[int], dst_gpus: Sequence[int]) -> float:
        if num_bytes <= 0 or list(src_gpus) == list(dst_gpus):
            return 0.0
        gpus = [*src_gpus, *dst_gpus]
        if self.comm_source("p2p", 2, cross_node=self._spans_nodes(gpus)) != "measured":
            return super().transfer_s(num_bytes, src_gpus, dst_gpus)
        # `lanes` GPU pairs each move their share at once, over their own NVLink ports.
        lanes = min(len(src_gpus), len(dst_gpus))
        return _interp_s(self._comm[("p2p", 2)], num_bytes / lanes)

    def comm_time(self, kind: str, num_bytes: float, num_gpus: int) -> tuple[float, str]:
        """(seconds, source) of one `kind` op (db.COMM_KINDS says what `num_bytes` counts) over
        `num_gpus` GPUs filling nodes in order. source: 'measured' (the DB's curve for this kind
        and GPU count), 'extrapolated' (another count's curve, ring-scaled) or 'analytic' (the
        link model: no curve for the kind, or the group spans nodes, where NVLink curves lie)."""
        return self._comm_s(kind, num_bytes, list(range(num_gpus)))

    def comm_source(self, kind: str, num_gpus: int, *, cross_node: bool = False) -> str:
        """Where comm_time's number for `kind` over `num_gpus` GPUs comes from."""
        _check_comm(kind, num_gpus)
        if num_gpus <= 1 or cross_node:
            return "analytic"
        if (kind, num_gpus) in self._comm:
            return "measured"
        if kind not in P2P_KINDS and self._measured_counts(kind):
            return "extrapolated"
        return "analytic"

    def _comm_s(self, kind: str, num_bytes: float, gpus: list[int]) -> tuple[float, str]:
        n = len(gpus)
        source = self.comm_source(kind, n, cross_node=self._spans_nodes(gpus))
        if n <= 1 or num_bytes <= 0:
            return 0.0, source
        if source == "analytic":
            return self._analytic_comm_s(kind, num_bytes, gpus), source
        # Same bus bandwidth as the measured count: n GPUs move bus_factor(n) / bus_factor(n0)
        # as many bytes per link (ring all-reduce 2(n-1)/n, reduce-scatter/all-gather (n-1)/n).
        n0 = n if source == "measured" else self._nearest_count(kind, n)
        scale = comm_bus_factor(kind, n) / comm_bus_factor(kind, n0)
        return _interp_s(self._comm[(kind, n0)], num_bytes * scale), source

    def _analytic_comm_s(self, kind: str, num_bytes: float, gpus: list[int]) -> float:
        """PerfModel's link model for all-reduce and p2p (a full-duplex link moves both ways
        at once); reduce-scatter / all-gather / broadcast in the same ring form, n-1 steps."""
        if kind == "allreduce":
            return super().allreduce_s(num_bytes, gpus)
        if kind in P2P_KINDS:
            return super().transfer_s(num_bytes, gpus[:1], gpus[1:])
        n = len(gpus)
        latency_s = (n - 1) * self.cluster.collective_latency_s / 4
        return latency_s + comm_bus_factor(kind, n) * num_bytes / self.cluster.link_bandwidth_bps(gpus)

    def intra_node_collective_s(self, kind: str, num_bytes: float, num_gpus: int) -> float:
        """Inside a node the measured NVLink curves (ring-scaled to other counts) apply."""
        if num_gpus <= 1 or num_bytes <= 0:
            return 0.0
        return self._comm_s(kind, num_bytes, list(range(num_gpus)))[0]

    def _measured_counts(self, kind: str) -> list[int]:
        return sorted(n for k, n in self._comm if k == kind)

    def _nearest_count(self, kind: str, num_gpus: int) -> int:
        """The measured GPU count to scale from: the largest at most num_gpus, else the least."""
        counts = self._measured_counts(kind)
        below = [n for n in counts if n <= num_gpus]
        return below[-1] if below else counts[0]

    def _spans_nodes(self, gpus: Sequence[int]) -> bool:
        return self.cluster.spans_nodes(list(gpus))

    def comm_summary(self) -> str:
        """Which comm curves are measured, extrapolated or analytic on this cluster."""
        top = min(self.cluster.num_gpus, self.cluster.gpus_per_node)
        parts, analytic = [], []
        for kind in COMM_KINDS:
            measured = self._measured_counts(kind)
            if not measured:
                analytic.append(kind)
                continue
            extra = [] if kind in P2P_KINDS else [n for n in range(2, top + 1) if n not in measured]
            parts.append(f"{kind} measured n={_counts(measured)}"
                         + (f", extrapolated n={_counts(extra)}" if extra else ""))
        if not parts:
            return "comm: analytic (no measured curves)"
        tail = f"; analytic: {', '.join(analytic)}" if analytic else ""
        across = ("; analytic across nodes (hierarchical: in-node curves + IB leads)"
                  if self.cluster.num_nodes > 1 else "")
        return f"comm: {'; '.join(parts)}{tail}{across}"


def remeasure_command(model: str, preset: str, kernels: str) -> str:
    """The command that measures a model's surfaces of these kernels again, replacing them."""
    flag = "" if kernels == "eager" else f" --kernels {kernels}"
    return (f"`mosaic profile {model} --preset {preset}{flag} --surfaces-only --update "
            "--remeasure`")


def drift_finding(drift: Mapping[str, Any], kernels: str) -> str:
    """What SurfaceSet.drift found for one module, and the command that measures it again."""
    return (f"its {kernels} surface says {drift['surface_over_measured']:.2f}x the alone time "
            f"measured beside {drift['colocations']} colocations; stale? measure it again: "
            f"{remeasure_command(drift['model'], drift['preset'], kernels)}")


def interference_choice_name(kernels: str) -> str:
    """The `fits` row that says on which colocations (eager, or these kernels' own) a model of
    compiled kernels fits its interference (accuracy.interference_choice)."""
    return f"interference_choice.{kernels}"


def interference_fit_name(variant: str, kernels: str = "eager") -> str:
    """The `fits` row of an interference variant fitted on colocations of these kernels (the
    eager one keeps its original name)."""
    return f"model_error.{variant}" + ("" if kernels in ("eager", "mixed") else f".{kernels}")


def _stored_params(fit: FitRecord | None, variant: str) -> InterferenceParams | None:
    """Coefficients the profiling run stored beside their held-out error (None: refit,
    e.g. when the model's parameters changed since)."""
    if fit is None or fit.params.get("variant") != variant:
        return None
    try:
        return InterferenceParams(**fit.params)
    except (TypeError, ValueError):
        return None


def _open(db: ProfileDB | str | Path | None, cluster: ClusterSpec) -> ProfileDB:
    if isinstance(db, ProfileDB):
        return db
    if db is None:
        path = default_db_path(cluster.gpu.name)
        if not path.is_file():
            raise ProfileDBError(f"no shipped profile DB for {cluster.gpu.name} at {path}; "
                                 "profile it (benchmarks/profile_h200.py) and pass --db PATH")
        db = path
    return ProfileDB.open(db, hardware=cluster.gpu.name)


def _comm_curves(db: ProfileDB) -> dict[tuple[str, int], np.ndarray]:
    """Measured (never analytic) comm curves: (kind, num_gpus) -> [[bytes, seconds], ...],
    bytes ascending, repeated sizes by their median, times made non-decreasing (a larger
    message is never faster; a noisy dip would bend the interpolation)."""
    rows: dict[tuple[str, int], dict[float, list[float]]] = {}
    for p in db.comm():
        if p.source == "measured" and p.num_bytes > 0 and p.time_s > 0:
            rows.setdefault((p.kind, p.num_gpus), {}).setdefault(p.num_bytes, []).append(p.time_s)
    curves = {}
    for key, by_size in rows.items():
        if len(by_size) >= 2:
            x = np.array(sorted(by_size))
            t = np.maximum.accumulate([float(np.median(by_size[b])) for b in x])
            curves[key] = np.column_stack([x, t])
    return curves


def _interp_s(curve: np.ndarray, num_bytes: float) -> float:
    """Log-log interpolation between measured sizes; outside them, the latency + bytes /
    bandwidth line through the two end points (exact for t = a + x / B)."""
    x, t = curve[:, 0], curve[:, 1]
    if num_bytes > x[-1]:
        dt = t[-1] - t[-2]
        # a flat end pair (noise made monotone) has no slope: the largest message's rate
        bandwidth = (x[-1] - x[-2]) / dt if dt > 0 else x[-1] / t[-1]
        return float(t[-1] + (num_bytes - x[-1]) / bandwidth)
    if num_bytes < x[0]:
        dt = t[1] - t[0]
        if dt <= 0:  # latency-bound: as fast as the smallest message
            return float(t[0])
        line = t[0] - (x[0] - num_bytes) * dt / (x[1] - x[0])
        # a line with a negative intercept would reach 0 s: not below proportional-to-bytes
        return float(max(line, t[0] * num_bytes / x[0]))
    return float(np.exp(np.interp(np.log(num_bytes), np.log(x), np.log(t))))


def _check_comm(kind: str, num_gpus: int) -> None:
    if kind not in COMM_KINDS:
        raise ValueError(f"unknown comm kind {kind!r}; choose one of {COMM_KINDS}")
    if kind in P2P_KINDS and num_gpus != 2:
        raise ValueError(f"{kind} is between 2 GPUs, not {num_gpus}; for several pairs at once "
                         "use transfer_s(num_bytes, src_gpus, dst_gpus)")


def _counts(ns: Sequence[int]) -> str:
    """[2] -> '2', [2, 4] -> '2,4', [3, 4, 5, 6] -> '3-6'."""
    runs: list[list[int]] = []
    for n in ns:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)
