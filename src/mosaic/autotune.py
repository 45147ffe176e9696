"""Measured plan selection: the model proposes, a short measurement decides.

The performance model ranks plans well but not perfectly (whole-iteration errors of a few
percent, larger on an engine it was not fitted for), and plans it predicts within a few
percent of each other are a coin toss. So: take the K best distinct predicted plans of every
planner, add the baselines (megatron, distmm, spindle: always candidates, so the chosen plan
is never measured slower than the best baseline), measure them all briefly in one process
per GPU with `measure_plans` (interleaved rounds, gradients checked), and keep the fastest.
Every measurement is written to the ProfileDB `iterations` table, so the next engine-term
refit (perf/engine_term.py) learns from every autotune run: the DB the model was loaded from
when it is the user's own, else a copy of the shipped one under runs/
(`record_db_for`), since the package's data is never written.

`measure_plans` is collective: under torchrun every rank calls `autotune` together; the
candidates are made on rank 0 and shared, so every rank measures the same plans.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sqlite3
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from mosaic.engine.measure import (
    BASELINES,
    BenchConfig,
    PlanMeasurement,
    measure_plans,
    variant_label,
)
from mosaic.engine.session import EngineConfig, start_distributed
from mosaic.errors import MosaicError
from mosaic.graph import MMGraph
from mosaic.hardware import ClusterSpec
from mosaic.perf.base import PerfModel
from mosaic.perf.engine_term import engine_kind
from mosaic.plan import Plan, PlanError, run_key
from mosaic.profile.db import IterationRecord, ProfileDB, ProfileDBError, default_db_path

CANDIDATE_PLANNERS = ("mosaic", "mosaic-partition", "mosaic-unaware", "exhaustive", "gahc",
                      *BASELINES)
EXHAUSTIVE_MAX_MODULES = 6
"""Exhaustive search only where it is cheap: its space grows as the Bell numbers."""
SEARCH_LIMIT_S = 10.0
"""Wall-time cap of the exhaustive and GAHC searches (a start-up cost, not a training one)."""
PER_WEIGHT_UPDATE = {"bf16_flat_grads": False}
"""With bf16 weights, the best predicted plan is measured once more updating its weights a
weight at a time (no flat gradient copy): which update is faster is the model's (H200: a
weight at a time 1.035x on Unified-IO 2 `paper` b4 and 1.026x on Qwen3-VL `small` b8, flat
1.01-1.03x on CLIP `paper` b32). The profiled model prices it from each module's measured
update (profile/main_weights.py), but the difference is often tenths of a millisecond, within
the model's error, so it is measured too."""


class AutotuneError(MosaicError):
    """Autotune asked for something it cannot do; the message names the field and the fix."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AutotuneConfig:
    k: int = 3
    """The K best distinct predicted plans are measured (plus the baselines)."""
    rounds: int = 2
    steps_per_round: int = 3
    warmup_steps: int = 2
    in_flight_steps: int = 5
    """Each round, each candidate also runs this many steps back to back, read once; the
    plan kept is the one of the lowest such step, as `mosaic train` keeps its steps in flight
    (a per-step read leaves the GPU idle while the host starts the next step, which favours
    plans that launch fast). 0: the lowest per-step median decides."""
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(graphs=True))
    planners: tuple[str, ...] = CANDIDATE_PLANNERS
    seed: int = 0

    def __post_init__(self) -> None:
        if self.k < 1:
            raise AutotuneError(f"k={self.k}: autotune measures the K best plans; give K >= 1")
        if self.in_flight_steps < 0:
            raise AutotuneError(f"in_flight_steps={self.in_flight_steps}: give 0 (rank by the "
                                "per-step median) or more")
        if not set(BASELINES) <= set(self.planners):
            raise AutotuneError(f"planners {self.planners} must include the baselines "
                                f"{BASELINES}: they guarantee no slower-than-baseline choice")


@dataclass(frozen=True, slots=True)
class TuneMeasurement:
    label: str
    predicted_s: float
    measured_s: float
    startup_s: float
    """Seconds to build and capture this plan's session (rank 0)."""
    baseline: bool
    same_as: tuple[str, ...] = ()
    """Other planners whose plan had the same placement structure (measured once)."""
    engine_settings: dict[str, Any] = field(default_factory=dict)
    """Engine settings it ran with beyond the run's (PER_WEIGHT_UPDATE for that candidate)."""
    in_flight_s: float | None = None
    """Median step of its windows of steps run back to back (None: none were run)."""

    @property
    def ranked_s(self) -> float:
        """What the candidates are ranked by: the step in flight where measured."""
        return self.measured_s if self.in_flight_s is None else self.in_flight_s

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "predicted_s": self.predicted_s,
                "measured_s": self.measured_s, "in_flight_s": self.in_flight_s,
                "startup_s": self.startup_s, "baseline": self.baseline,
                "same_as": list(self.same_as), "engine_settings": self.engine_settings}


@dataclass(frozen=True, slots=True)
class AutotuneResult:
    plan: Plan
    """The fastest measured candidate, `meta["autotune"]` saying how it was chosen."""
    label: str
    measurements: tuple[TuneMeasurement, ...]
    startup_s: float
    """Wall seconds of the whole autotune: planning, building, capturing and measuring."""
    best_baseline_s: float
    """The fastest baseline's step, ranked as the candidates were (TuneMeasurement.ranked_s)."""

    @property
    def measured_s(self) -> float:
        """The chosen plan's per-step median."""
        return self._chosen.measured_s

    @property
    def ranked_s(self) -> float:
        """The chosen plan's step as the candidates were ranked (in flight where measured)."""
        return self._chosen.ranked_s

    @property
    def engine_settings(self) -> dict[str, Any]:
        """Engine settings the chosen candidate ran with beyond the run's (PER_WEIGHT_UPDATE
        when its weights went a weight at a time): train with them."""
        return self._chosen.engine_settings

    @property
    def _chosen(self) -> TuneMeasurement:
        return next(m for m in self.measurements if m.label == self.label)

    def to_dict(self) -> dict[str, Any]:
        return {"chosen": self.label, "engine_settings": self.engine_settings,
                "startup_s": self.startup_s, "best_baseline_s": self.best_baseline_s,
                "measurements": [m.to_dict() for m in self.measurements]}


# --- candidates ----------------------------------------------------------------------------
def _run_planner(name: str, graph: MMGraph, cluster: ClusterSpec, perf: PerfModel) -> Plan | None:
    """The planner's plan, or None where it has none here (too costly, or no plan fits)."""
    return _planned(name, graph, cluster, perf)


def _planned(name: str, graph: MMGraph, cluster: ClusterSpec, perf: PerfModel) -> Plan | None:
    from mosaic.planners import get_planner, run_planner
    from mosaic.planners.exhaustive import ExhaustiveConfig, plan_exhaustive
    from mosaic.planners.gahc import GAHCConfig, plan_gahc

    planner = get_planner(name)
    if name == "exhaustive":
        if len(graph.modules) > EXHAUSTIVE_MAX_MODULES:
            return None
        planner = partial(plan_exhaustive, config=ExhaustiveConfig(time_limit_s=SEARCH_LIMIT_S))
    elif name == "gahc":
        planner = partial(plan_gahc, config=GAHCConfig(time_limit_s=SEARCH_LIMIT_S))
    try:  # run_planner: an accumulating model plans one micro-step
        return run_planner(planner, graph, cluster, perf)
    except PlanError:
        return None


def candidate_plans(graph: MMGraph, cluster: ClusterSpec, perf: PerfModel, k: int,
                    planners: tuple[str, ...] = CANDIDATE_PLANNERS
                    ) -> tuple[dict[str, Plan], dict[str, list[str]]]:
    """The K best distinct predicted plans plus every baseline's, by label (the planner that
    made it; `mosaic#N` for the mosaic search's N-th best plan), best predicted first; and
    per label the other labels whose plan runs the same (`run_key`: measured once)."""
    made = {n: p for n in planners if (p := _run_planner(n, graph, cluster, perf)) is not None}
    if not made:
        raise AutotuneError(f"no planner of {planners} found a plan of {graph.name} on "
                            f"{cluster.num_gpus} GPU(s); check --gpus and --batch")
    if "mosaic" in planners and k > 1:
        made.update(_mosaic_alternatives(graph, cluster, perf, k))
    ranked = sorted(made, key=lambda n: (made[n].predicted_iteration_s, n not in BASELINES,
                                         "#" in n))
    chosen: dict[tuple, str] = {}
    aliases: dict[str, list[str]] = {}
    for label in ranked:
        key = run_key(made[label])
        if key in chosen:
            aliases[chosen[key]].append(label)
        elif len(chosen) < k or label in BASELINES:
            chosen[key] = label
            aliases[label] = []
    return {n: made[n] for n in ranked if n in aliases}, aliases


def _mosaic_alternatives(graph: MMGraph, cluster: ClusterSpec, perf: PerfModel,
                         k: int) -> dict[str, Plan]:
    """The mosaic search's best distinct plans after its first, as `mosaic#2`...: plans
    predicted within the model's error of the best are worth a measurement. 2K of them, as
    some run like another planner's plan (candidate_plans keeps K distinct)."""
    from mosaic.planners import one_micro_step
    from mosaic.planners.mosaic import plan_mosaic_alternatives

    try:
        micro, per_micro_step = one_micro_step(graph, perf)
        found = plan_mosaic_alternatives(micro, cluster, per_micro_step, 2 * k)
    except PlanError:
        return {}
    if perf.accumulation > 1:  # searched for one micro-step, predicted for the whole step
        found = [perf.predict(p, graph) for p in found]
    return {f"mosaic#{p.meta['alternative']}": p for p in found if p.meta["alternative"] > 1}


# --- measuring -----------------------------------------------------------------------------
def _bench_config(config: AutotuneConfig) -> BenchConfig:
    """Brief: the plans alone (no user programs), no NVML pass; gradients still checked, so a
    plan that computes something else can never win."""
    return BenchConfig(rounds=config.rounds, steps_per_round=config.steps_per_round,
                       warmup_steps=config.warmup_steps, engine=config.engine, user_programs=(),
                       nvml_seconds=0.0, in_flight_steps=config.in_flight_steps,
                       seed=config.seed)


def _records(measured: list[PlanMeasurement], aliases: dict[str, list[str]]
             ) -> tuple[TuneMeasurement, ...]:
    return tuple(TuneMeasurement(
        label=m.label, predicted_s=float(m.plan.predicted_iteration_s or 0.0),
        measured_s=m.median_s, startup_s=m.startup_s,
        baseline=bool({m.label, *aliases.get(m.label, [])} & set(BASELINES)),
        same_as=tuple(aliases.get(m.label, [])), engine_settings=dict(m.engine_variant or {}),
        in_flight_s=m.in_flight_median_s)
        for m in measured)


def autotune(model: Any, preset: str, graph: MMGraph, cluster: ClusterSpec, perf: PerfModel,
             config: AutotuneConfig | None = None, *, db: str | Path | None = None
             ) -> AutotuneResult:
    """The fastest measured of the candidate plans (collective: every rank calls it). `db`:
    a ProfileDB to append the measurements to (rank 0 writes; None: not recorded)."""
    from mosaic.engine.comm import share_from_rank0

    config = config or AutotuneConfig()
    start = time.perf_counter()
    d = start_distributed(None)
    try:
        shared = share_from_rank0(lambda: _shared_candidates(graph, cluster, perf, config),
                                  d.device)
        plans = {k: Plan.from_dict(v) for k, v in shared["plans"].items()}
        try:
            measured, _ = measure_plans(model, preset, graph, plans, cluster.gpu,
                                        _bench_config(config),
                                        {label: replace(config.engine, **PER_WEIGHT_UPDATE)
                                         for label in _update_candidates(plans, config.engine)})
        except RuntimeError as exc:
            failure = _device_failure(exc, plans, shared["aliases"])
            if failure is None:
                raise
            raise failure from exc
    finally:
        from mosaic.engine.session import end_distributed

        end_distributed(d)
    records = _records(measured, shared["aliases"])
    result = _choose(records, plans, time.perf_counter() - start)
    if db is not None and d.rank == 0:
        try:
            record_iterations(db, graph, preset, result, plans, perf, _measured_engine(config, d))
        except (ProfileDBError, sqlite3.Error) as exc:  # the choice stands; only the record is lost
            warnings.warn(f"autotune: measurements not recorded in {db}: {exc}", stacklevel=2)
    return result


def _device_failure(exc: RuntimeError, plans: dict[str, Plan],
                    aliases: dict[str, list[str]]) -> AutotuneError | None:
    """A CUDA error while measuring leaves this process's GPU context unusable, so no plan
    can be trained in it: say so with the way on (OFASys `paper` with bf16 weights met one in
    cuBLAS on the H200, 2026-12-03, while its planner's plan alone trained)."""
    if "CUDA error" not in str(exc) and "CUBLAS_STATUS" not in str(exc):
        return None
    whose = getattr(exc, "contender", None)
    where = f" in {whose!r}'s step" if whose else ""
    planner = plans[whose].planner if whose in plans else None
    # the planners that made the same plan (`mosaic#2` is the mosaic search's too)
    same_plan = list(dict.fromkeys(label.split("#")[0]
                                   for label in [planner or "", *aliases.get(whose, [])]))
    others = (f"Measure the other candidates: rerun with --autotune-skip {','.join(same_plan)}; "
              "or train " if planner is not None and planner not in BASELINES else "Train ")
    return AutotuneError(
        f"autotune: measuring the candidate plans ({', '.join(plans)}) failed on the GPU"
        f"{where} ({str(exc).splitlines()[0][:160]}); the process cannot go on after a CUDA "
        f"error. {others}the planner's plan instead: drop --autotune (or name one with "
        f"--planner)")


def autotune_planners(skip: Sequence[str] = ()) -> tuple[str, ...]:
    """The planners whose plans autotune measures, less `skip` (`--autotune-skip`: a planner
    whose plan fails on the GPU). The baselines are always measured: they make sure the choice
    is never slower than them."""
    skippable = [p for p in CANDIDATE_PLANNERS if p not in BASELINES]
    unknown = sorted(set(skip) - set(CANDIDATE_PLANNERS))
    if unknown:
        raise AutotuneError(f"--autotune-skip {','.join(unknown)}: not a candidate planner; "
                            f"skip some of {', '.join(skippable)}")
    baselines = sorted(set(skip) & set(BASELINES))
    if baselines:
        raise AutotuneError(f"--autotune-skip {','.join(baselines)}: the baselines "
                            f"({', '.join(BASELINES)}) are always measured, so the choice is "
                            f"never slower than them; skip some of {', '.join(skippable)}")
    return tuple(p for p in CANDIDATE_PLANNERS if p not in skip)


def autotune_recorded(model: Any, preset: str, graph: MMGraph, cluster: ClusterSpec,
                      perf: PerfModel, k: int, engine: EngineConfig, *, cpu: bool,
                      skip: Sequence[str] = ()) -> tuple[AutotuneResult, Path | None]:
    """`autotune` as `mosaic train` and `mosaic bench` run it: on a GPU the measurements go
    to the profiled model's DB (the shipped one: a copy under runs/) for the next engine-term
    refit, and the DB is returned; CPU timings would only pollute it (brief steps, no DB)."""
    steps = {"steps_per_round": 1, "warmup_steps": 1} if cpu else {}
    rank0 = int(os.environ.get("RANK", "0")) == 0
    db = None if cpu or not rank0 else record_db_for(perf, cluster.gpu.name)
    config = AutotuneConfig(k=k, engine=engine, planners=autotune_planners(skip), **steps)
    return autotune(model, preset, graph, cluster, perf, config, db=db), db


def record_db_for(perf: PerfModel, hardware: str, folder: str | Path = "runs") -> Path | None:
    """Where autotune records its measurements: the DB `perf` was loaded from when it is the
    user's own; for the shipped DB (installed package data, replaced on upgrade) a copy in
    `folder`, made once and appended to after, which `--profile-db` and the engine-term refit
    then read. None: the model has no DB (analytic)."""
    loaded = getattr(perf, "db_path", None)
    if loaded is None:
        return None
    shipped = default_db_path(hardware)
    if not shipped.is_file() or Path(loaded).resolve() != shipped.resolve():
        return Path(loaded)
    own = Path(folder) / f"profile-{hardware.lower()}.sqlite"
    if not own.exists():
        own.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shipped, own)
    return own


def _shared_candidates(graph: MMGraph, cluster: ClusterSpec, perf: PerfModel,
                       config: AutotuneConfig) -> dict[str, Any]:
    plans, aliases = candidate_plans(graph, cluster, perf, config.k, config.planners)
    return {"plans": {k: p.to_dict() for k, p in plans.items()}, "aliases": aliases}


def _update_candidates(plans: dict[str, Plan], engine: EngineConfig) -> list[str]:
    """With bf16 weights updated over flat buffers, the best predicted plan once more with
    PER_WEIGHT_UPDATE, added to `plans`; returns the labels added."""
    if not (engine.bf16_weights and engine.bf16_flat_grads) or not plans:
        return []
    best = next(iter(plans))  # candidate_plans: best predicted first
    label = variant_label(best, PER_WEIGHT_UPDATE)
    plans[label] = plans[best]
    return [label]


def _measured_engine(config: AutotuneConfig, d: Any) -> str:
    """The engine the plans actually ran on (measure_plans turns CUDA graphs off on CPU)."""
    graphs = config.engine.graphs and d.device.type == "cuda"
    record = {**asdict(config.engine), "graphs": graphs}
    return engine_kind(record, d.world_size) + ("" if d.device.type == "cuda" else "@cpu")


def _choose(records: tuple[TuneMeasurement, ...], plans: dict[str, Plan],
            startup_s: float) -> AutotuneResult:
    """The fastest measured plan (TuneMeasurement.ranked_s); baselines are candidates, so it
    is never slower than the best."""
    best = min(records, key=lambda r: r.ranked_s)
    best_baseline = min(r.ranked_s for r in records if r.baseline)
    info = {"chosen": best.label, "chosen_from": [r.to_dict() for r in records],
            "startup_s": startup_s, "best_baseline_s": best_baseline,
            "engine_settings": best.engine_settings}
    plan = replace(plans[best.label], meta={**plans[best.label].meta, "autotune": info})
    return AutotuneResult(plan=plan, label=best.label, measurements=records, startup_s=startup_s,
                          best_baseline_s=best_baseline)


def record_iterations(db_path: str | Path, graph: MMGraph, preset: str, result: AutotuneResult,
                      plans: dict[str, Plan], perf: PerfModel, engine: str) -> int:
    """Append every measurement to the DB's `iterations` table; returns the rows written."""
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    term = getattr(perf, "engine_term_s", None)
    # A candidate on other engine settings ran another engine than `engine`: not a row for
    # that engine's term.
    measured = [m for m in result.measurements if not m.engine_settings]
    rows = [IterationRecord(
        plan_json=json.dumps(plans[m.label].to_dict(), sort_keys=True), label=m.label,
        model=graph.name, preset=preset, global_batch=graph.global_batch,
        num_gpus=plans[m.label].num_gpus, predicted_s=m.predicted_s,
        engine_term_s=float(term(plans[m.label], graph)) if term else 0.0,
        measured_s=m.measured_s, engine=engine, perf_model=perf.describe(), date=date)
        for m in measured]
    with ProfileDB.open(db_path, readonly=False) as db:
        db.add_iterations(rows)
    return len(rows)
