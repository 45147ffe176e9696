"""A fitted per-step engine term: what whole iterations cost beyond the composed prediction.

The profiled model composes module surfaces, interference and comm; the engine adds work no
surface sees (launches, per-stage synchronisation, per-parameter optimizer and gradient
bookkeeping), and a compiled engine runs kernels faster than the eagerly profiled surfaces.
From bench rows (predicted_iteration_s, measured_iteration_s, the plan) this fits

    measured - predicted = sum_i coef_i * feature_i(plan, graph, predicted)

by weighted least squares (weights 1 / measured: the error that matters is relative), with
the feature set chosen by leave-one-file-out error: a term that does not predict files it
was not fitted on is not kept. Engines differ (eager vs CUDA graphs + Inductor), so each
engine kind gets its own fit, stored as `engine_term.<kind>` in the ProfileDB `fits` table
and applied only to predictions for that kind (ProfiledModel(engine=kind)).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from mosaic.errors import MosaicError
from mosaic.graph import MMGraph
from mosaic.perf.results import bench_result_files, graph_of, load_current_result
from mosaic.plan import Plan, PlanError
from mosaic.profile.db import TUNED_MODES, FitRecord, ProfileDB, kernels_label

FIT_PREFIX = "engine_term."
FEATURES = ("const", "stages", "busiest_modules", "params", "synced_params", "micro_steps",
            "predicted", "colocation_saving")
"""const: 1 (seconds per step); stages: plan stages (a synchronisation each); busiest_modules:
most placements on one GPU (launch and hook work per module); params: parameters on the GPU
holding most (optimizer and gradient bookkeeping per parameter); synced_params: the same for
placements synchronised across GPUs (DDP's bucket copies and the collectives' contention with
compute, beyond the all-reduce the model already counts); micro_steps: micro-batches beyond
the first times the composed prediction (each one more pass of every module at a smaller,
less efficient batch, beyond what the pipelined composition counts); predicted: the composed
prediction itself (kernels uniformly faster or slower than profiled, e.g. Inductor);
colocation_saving: what the composition says running modules side by side saves, the same
placements run one after another minus the plan (interference is fitted on eager
colocations; fitted on the bench rows, 55% of that saving did not show with compiled
kernels and 38% eagerly)."""
FEATURE_SETS: tuple[tuple[str, ...], ...] = (
    ("const",), ("predicted",), ("const", "predicted"), ("const", "params"),
    ("const", "stages"), ("const", "busiest_modules"), ("const", "stages", "params"),
    ("const", "busiest_modules", "params"), ("const", "params", "predicted"),
    ("const", "synced_params"), ("const", "predicted", "synced_params"),
    ("const", "params", "synced_params"), ("predicted", "micro_steps"),
    ("const", "predicted", "micro_steps"), ("const", "predicted", "synced_params", "micro_steps"),
    ("const", "stages", "busiest_modules", "params"),
    ("const", "colocation_saving"), ("const", "stages", "colocation_saving"),
    ("const", "busiest_modules", "colocation_saving"),
    ("const", "predicted", "colocation_saving"),
    ("const", "predicted", "synced_params", "colocation_saving"),
)
"""Candidates, fewest features first (a tie in held-out error keeps the simpler term)."""
PERCENT = 100.0
MIN_FRACTION = 0.1
"""A corrected iteration is at least this fraction of the composed prediction."""


class EngineTermError(MosaicError):
    """Rows an engine term cannot be fitted on; the message names what is missing and the fix."""


@dataclass(frozen=True, slots=True)
class IterationRow:
    """One measured plan: its composed prediction (without any engine term) and measurement."""

    group: str
    """Held-out unit: the results file (or DB run) it came from."""
    engine: str
    features: dict[str, float]
    predicted_s: float
    measured_s: float
    label: str = ""


@dataclass(frozen=True, slots=True)
class EngineTerm:
    """measured - predicted = coef . features, for one engine kind."""

    engine: str
    features: tuple[str, ...]
    coef: tuple[float, ...]
    mape: float | None = None
    """Held-out (leave-one-file-out) MAPE of the corrected prediction, percent."""
    baseline_mape: float | None = None
    """The same rows' MAPE without the term, percent."""
    n_points: int = 0
    groups: tuple[str, ...] = ()

    def seconds(self, features: dict[str, float]) -> float:
        """The term for one plan; never below -90% of the composed prediction (a term fitted on
        a few runs, extrapolated far, must not predict a free or negative iteration)."""
        term = sum(c * features[f] for f, c in zip(self.features, self.coef, strict=True))
        return float(max(term, (MIN_FRACTION - 1.0) * features["predicted"]))

    def describe(self) -> str:
        unit = {"const": "{:+.3g} ms", "stages": "{:+.3g} ms/stage",
                "busiest_modules": "{:+.3g} ms/module", "params": "{:+.3g} ns/param",
                "synced_params": "{:+.3g} ns/synced param",
                "micro_steps": "{:+.3g}% x predicted per extra micro-batch",
                "predicted": "{:+.3g}% x predicted",
                "colocation_saving": "{:+.3g}% x the colocation saving"}
        scale = {"params": 1e9, "synced_params": 1e9, "predicted": PERCENT, "micro_steps": PERCENT,
                 "colocation_saving": PERCENT}
        terms = " ".join(unit[f].format(c * scale.get(f, 1e3))
                           for f, c in zip(self.features, self.coef, strict=True)) or "none"
        err = (f", held-out MAPE {self.mape:.1f}% (uncorrected {self.baseline_mape:.1f}%)"
               if self.mape is not None and self.baseline_mape is not None else "")
        return (f"engine term [{self.engine}]: {terms}; fitted on {self.n_points} iterations "
                f"from {len(self.groups)} runs{err}")

    def to_fit(self) -> FitRecord:
        params = {"engine": self.engine, "features": list(self.features),
                  "coef": list(self.coef), "baseline_mape": self.baseline_mape,
                  "groups": list(self.groups)}
        return FitRecord(name=FIT_PREFIX + self.engine, params=params, mape=self.mape,
                         n_points=self.n_points,
                         created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))

    @classmethod
    def from_fit(cls, fit: FitRecord) -> EngineTerm | None:
        """None when the stored record is not one this code can apply (features changed)."""
        p = fit.params
        try:
            features, coef = tuple(p["features"]), tuple(float(c) for c in p["coef"])
        except (KeyError, TypeError, ValueError):
            return None
        if set(features) - set(FEATURES) or len(features) != len(coef):
            return None
        return cls(engine=str(p.get("engine", fit.name.removeprefix(FIT_PREFIX))),
                   features=features, coef=coef, mape=fit.mape,
                   baseline_mape=p.get("baseline_mape"), n_points=fit.n_points or 0,
                   groups=tuple(p.get("groups", ())))


# --- features ------------------------------------------------------------------------------
GPU_ENGINE = {"graphs": True, "compile": "default", "grad_sync": "flat", "reduce_dtype": "fp32",
              "grads_in_graph": True}
"""The engine record of what `mosaic bench` (and `mosaic train`)
runs on a GPU unless told otherwise (a test checks it against EngineConfig's defaults)."""


def gpu_engine_kind(gpus: int | None = None) -> str:
    """The engine kind of the default GPU engine on `gpus` GPUs."""
    return engine_kind(GPU_ENGINE, gpus)


BF16_WEIGHTS = "bf16-weights"
"""The engine-kind part of an engine that keeps bf16 GEMM weights and fp32 main weights."""
PER_WEIGHT_UPDATE = "per-weight-update"
"""With bf16 weights: the update launched a weight at a time, not over a flat gradient buffer."""
BF16_MOMENTS = "bf16-moments"
"""With bf16 weights: their AdamW moments kept in bf16 (the update moves fewer bytes)."""
NO_MAIN_WEIGHTS = "no-main-weights"
"""With bf16 weights: no fp32 main copies; the update rounds each new weight stochastically."""
FP8_FIRST_MOMENT = "fp8-first-moment"
"""With the update a weight at a time without main weights: AdamW's first moment in 8 bits.
Not profiled, priced as the bf16-moment update; a family of its own, as GROUPED_UPDATE."""
GROUPED_UPDATE = "grouped-update"
"""With the update a weight at a time: same-shaped weights several to a launch (combo
kernels). Not profiled: the composed time prices the update a launch a weight, and its rows
are a family of their own, so they cannot shift the ungrouped family's fitted term."""


BF16_REDUCE = "bf16-reduce"
"""The engine-kind part of reduce_dtype='bf16' (gradients summed in bf16: half the bytes)."""
OVERLAPPED_SYNC = "overlapped"
"""The engine-kind part of grad_sync='overlapped' (gradients summed during the backward)."""
UNPROFILED_UPDATES = (GROUPED_UPDATE, FP8_FIRST_MOMENT)
"""Updates the profile has not timed: their rows fit terms of their own (bf16_family)."""


def engine_kind(engine: dict[str, Any] | None, gpus: int | None = None) -> str:
    """The engine a measurement ran on, from a bench JSON's `engine` record: results without
    one come from the older eager engine; otherwise 'graphs' and/or 'compile-<mode>', plus the
    gradient synchronisation when it is not the default DDP in fp32 ('flat', 'bucketed',
    'bf16-reduce'; only where several GPUs (`gpus`) could synchronise: on one GPU these
    settings change nothing) and 'grads-in-graph' when backward graphs leave the gradients
    (not under DDP on several GPUs, which takes them from autograd):
    each has its own host cost, so each gets its own term. 'bf16-weights' last, for an engine
    that keeps bf16 GEMM weights (it shares its fp32 twin's term: term_engine), then how it
    updates them where not the default ('per-weight-update', 'bf16-moments',
    'no-main-weights', 'grouped-update', 'fp8-first-moment')."""
    if not engine:
        return "eager"
    parts = (["graphs"] if engine.get("graphs") else []) + (
        [f"compile-{engine['compile']}"] if engine.get("compile") else [])
    if engine.get("compile") and engine.get("compile_scope", "module") != "module":
        parts.append(f"{engine['compile_scope']}-scope")  # other kernels at block boundaries
    if gpus is None or gpus > 1:
        if engine.get("grad_sync", "ddp") != "ddp":
            parts.append(str(engine["grad_sync"]))
        if engine.get("reduce_dtype", "fp32") != "fp32":
            parts.append(f"{engine['reduce_dtype']}-reduce")
    # DDP hooks autograd's AccumulateGrad, so its modules' graphs hand gradients to autograd
    # (runner.gradient_home): on several GPUs under DDP, grads_in_graph changes nothing there.
    ddp_syncs = gpus is not None and gpus > 1 and engine.get("grad_sync", "ddp") == "ddp"
    if engine.get("graphs") and engine.get("grads_in_graph") and not ddp_syncs:
        parts.append("grads-in-graph")  # results before the field existed: False
    if engine.get("bf16_weights"):
        parts.append(BF16_WEIGHTS)
        if not engine.get("bf16_flat_grads", True):
            parts.append(PER_WEIGHT_UPDATE)
        if engine.get("bf16_moments"):
            parts.append(BF16_MOMENTS)
        if not engine.get("fp32_main_weights", True):
            parts.append(NO_MAIN_WEIGHTS)
        if engine.get("update_group", 1) > 1:
            parts.append(GROUPED_UPDATE)
        if engine.get("fp8_first_moment"):
            parts.append(FP8_FIRST_MOMENT)
    return "+".join(parts) or "eager"


def row_engine(report: dict[str, Any], row: dict[str, Any]) -> dict[str, Any] | None:
    """The engine one bench row ran on: the bench's, with the row's `engine_variant` (from
    `mosaic bench --engine-variant`) over it."""
    engine = report.get("engine")
    variant = row.get("engine_variant")
    return {**(engine or {}), **variant} if engine and variant else engine


def kernels_of_engine(engine: str | None) -> str:
    """The profile kernels (ProfileDB `kernels`) an engine kind runs: `compile-<mode>` when it
    compiles (with `-blocks` when it compiles layer by layer), else eager."""
    parts = (engine or "eager").split("+")
    for part in parts:
        if part.startswith("compile-"):
            return kernels_label(part.removeprefix("compile-"),
                                 "blocks" if "blocks-scope" in parts else "module")
    return "eager"


def sequential_plan(plan: Plan) -> Plan:
    """`plan` with every stage's placements run one after another, each on its whole GPU
    set's SMs: what its colocations are predicted to save is measured against this."""
    return replace(plan, stages=tuple(
        replace(s, sharing="temporal", placements=tuple(replace(p, sm_share=1.0)
                                                        for p in s.placements))
        for s in plan.stages))


def plan_features(plan: Plan, graph: MMGraph, predicted_s: float,
                  sequential_s: float | None = None) -> dict[str, float]:
    """FEATURES of one plan; `predicted_s` is its composed prediction without an engine term,
    `sequential_s` the same of `sequential_plan(plan)` (None: no colocation saving known)."""
    modules: dict[int, int] = {}
    params: dict[int, int] = {}
    synced: dict[int, int] = {}
    for stage in plan.stages:
        for p in stage.placements:
            count = graph.module(p.module).num_params // p.tensor_parallel
            for g in p.gpus:
                modules[g] = modules.get(g, 0) + 1
                params[g] = params.get(g, 0) + count
                if p.dp_degree > 1:
                    synced[g] = synced.get(g, 0) + count
    return {"const": 1.0, "stages": float(len(plan.stages)),
            "busiest_modules": float(max(modules.values(), default=0)),
            "params": float(max(params.values(), default=0)),
            "synced_params": float(max(synced.values(), default=0)),
            "micro_steps": float(plan.micro_batches - 1) * predicted_s,
            "predicted": float(predicted_s),
            "colocation_saving": max(0.0, float(sequential_s or predicted_s) - predicted_s)}


# --- rows ----------------------------------------------------------------------------------
def rows_from_results(paths: str | Path | Iterable[str | Path],
                      repredict: Any = None) -> list[IterationRow]:
    """Plan rows of `mosaic bench` results predicted by the profiled model (the term corrects
    that model; an analytic prediction has other errors). User programs have no plan, and a
    superseded run (results.superseded) measured an engine that no longer runs: both skipped.
    `repredict` (perf.repredict.Repredictor): fit against today's composed prediction (its
    surfaces, without any engine term) instead of the one each result recorded."""
    rows: list[IterationRow] = []
    graphs: dict = {}
    for name, path in bench_result_files(paths):
        report = load_current_result(path)
        if report is None:
            continue
        if repredict is None and not str(report.get("perf_model", "")).startswith("profiled"):
            continue
        graph = graph_of(report, graphs)
        for r in report.get("results", []):
            if not (r.get("plan") and r.get("measured_iteration_s")):
                continue
            engine = row_engine(report, r) or {}
            if (repredict is None and engine.get("accumulation", 1) > 1
                    and "accumulated" not in str(r["plan"].get("perf_model", ""))):
                continue  # predicted before the model knew of the engine's accumulation
            kind = engine_kind(engine, report.get("gpus"))
            predicted = (repredict.predict(report, r, engine_term=False) if repredict is not None
                         else r.get("predicted_iteration_s"))
            sequential = (repredict.predict(report, r, engine_term=False, sequential=True)
                          if repredict is not None else None)
            if predicted:
                rows.append(_row(name, kind, Plan.from_dict(r["plan"]), graph, float(predicted),
                                 float(r["measured_iteration_s"]), str(r.get("planner", "")),
                                 sequential))
    return rows


def rows_from_db(db: ProfileDB, repredict: Any = None) -> list[IterationRow]:
    """Iterations recorded by autotune runs (one held-out group per run), profiled-model only;
    `predicted_s - engine_term_s` is the composed prediction the term is fitted against
    (`repredict`: today's composed prediction instead)."""
    rows: list[IterationRow] = []
    graphs: dict = {}
    for it in db.iterations():
        if not it.perf_model.startswith("profiled"):
            continue
        try:
            plan = Plan.from_dict(json.loads(it.plan_json))
        except (PlanError, ValueError):
            continue  # a plan format this version cannot read: not evidence
        graph = graph_of({"model": it.model, "preset": it.preset,
                          "global_batch": it.global_batch}, graphs)
        composed = (it.predicted_s - it.engine_term_s if repredict is None else
                    repredict.predict_plan(db.hardware, it.engine, plan, graph, engine_term=False))
        sequential = (None if repredict is None else repredict.predict_plan(
            db.hardware, it.engine, sequential_plan(plan), graph, engine_term=False))
        rows.append(_row(f"db:{it.date}", it.engine, plan, graph, composed, it.measured_s,
                         it.label, sequential))
    return rows


def _row(group: str, kind: str, plan: Plan, graph: MMGraph, predicted_s: float,
         measured_s: float, label: str, sequential_s: float | None = None) -> IterationRow:
    return IterationRow(group=group, engine=kind,
                        features=plan_features(plan, graph, predicted_s, sequential_s),
                        predicted_s=predicted_s, measured_s=measured_s, label=label)


# --- fitting -------------------------------------------------------------------------------
def _solve(rows: Sequence[IterationRow], features: Sequence[str]) -> np.ndarray:
    """Weighted least squares on relative residuals, columns scaled to unit RMS (seconds and
    parameter counts differ by 1e10: unscaled, the solver would see a singular problem)."""
    x = np.array([[r.features.get(f, 0.0) for f in features] for r in rows])
    y = np.array([r.measured_s - r.predicted_s for r in rows])
    w = 1.0 / np.array([r.measured_s for r in rows])
    scale = np.sqrt(np.mean(x**2, axis=0))
    scale[scale == 0] = 1.0
    xs = x / scale

    def resid(c: np.ndarray) -> np.ndarray:
        return (xs @ c - y) * w

    sol = least_squares(resid, np.zeros(len(features)), method="lm" if len(rows) > len(
        features) else "trf")
    return sol.x / scale


def _mape(rows: Sequence[IterationRow], features: Sequence[str], coef: np.ndarray) -> float:
    errs = [abs(r.predicted_s + sum(c * r.features.get(f, 0.0) for f, c in zip(features, coef, strict=True))
                - r.measured_s) / r.measured_s for r in rows]
    return float(np.mean(errs)) * PERCENT


def identifiable(rows: Sequence[IterationRow], features: Sequence[str]) -> bool:
    """Whether the rows pin every coefficient: with collinear features (every run of one model
    has the same parameter count, so `const` and `params` move together) the split between
    them is arbitrary, fits held-out runs of that model, and is nonsense for any other."""
    x = np.array([[r.features.get(f, 0.0) for f in features] for r in rows])
    scale = np.sqrt(np.mean(x**2, axis=0))
    if np.any(scale == 0):
        return False
    return bool(np.linalg.matrix_rank(x / scale, tol=1e-6) == len(features))


def held_out_mape(rows: Sequence[IterationRow], features: Sequence[str]) -> float | None:
    """Leave-one-group-out MAPE (percent); None when there are too few groups or points."""
    groups = sorted({r.group for r in rows})
    if len(groups) < 2:
        return None
    errs = []
    for g in groups:
        train = [r for r in rows if r.group != g]
        test = [r for r in rows if r.group == g]
        if len(train) < len(features) + 1:
            return None
        errs += [_mape([r], features, _solve(train, features)) for r in test]
    return float(np.mean(errs))


def fit_engine_term(rows: Sequence[IterationRow], engine: str,
                    feature_sets: Sequence[Sequence[str]] = FEATURE_SETS) -> EngineTerm:
    """The feature set with the least held-out error, refitted on every row of `engine`; the
    empty term where none beats the uncorrected prediction on held-out runs (rows whose
    error no feature explains, e.g. a host-bound step, must not bend the others')."""
    mine = [r for r in rows if r.engine == engine]
    runs = len({r.group for r in mine})
    if runs < 2:
        raise EngineTermError(
            f"engine {engine!r}: {len(mine)} iteration rows from {runs} run(s); a held-out "
            "error needs at least 2 runs: add `mosaic bench` results JSON (--fit-engine-term "
            "DIR) or autotune runs of this engine")
    # Rows of one run share a model and batch: a coefficient is pinned by runs, not rows,
    # and each held-out fold trains on all runs but one (3 CLIP runs once fitted 3 features,
    # one of them +618% of the colocation saving).
    scored = [(err, len(fs), tuple(fs)) for fs in feature_sets
              if len(fs) < runs and identifiable(mine, fs)
              and (err := held_out_mape(mine, fs)) is not None]
    if not scored:
        raise EngineTermError(f"engine {engine!r}: {len(mine)} rows are too few for any feature "
                              f"set, or its features move together on them (one model's runs "
                              f"share a parameter count); add bench results of this engine, "
                              f"of another model too")
    err, _, features = min(scored)
    baseline = float(np.mean([abs(r.predicted_s / r.measured_s - 1) for r in mine])) * PERCENT
    if err >= baseline:  # no term predicts held-out runs better than none: store none
        return EngineTerm(engine=engine, features=(), coef=(), mape=baseline,
                          baseline_mape=baseline, n_points=len(mine),
                          groups=tuple(sorted({r.group for r in mine})))
    coef = _solve(mine, features)
    return EngineTerm(engine=engine, features=features, coef=tuple(map(float, coef)), mape=err,
                      baseline_mape=baseline, n_points=len(mine),
                      groups=tuple(sorted({r.group for r in mine})))


def fit_engine_terms(rows: Sequence[IterationRow]) -> dict[str, EngineTerm]:
    """One term per engine kind that has enough rows, bf16-weight kinds pooled by family
    (fitted_kind); kinds with too few are left out."""
    rows = fitted_rows(rows)
    terms = {}
    for kind in sorted({r.engine for r in rows}):
        try:
            terms[kind] = fit_engine_term(rows, kind)
        except EngineTermError:
            continue
    return terms


def fitted_rows(rows: Sequence[IterationRow]) -> list[IterationRow]:
    """`rows` with each engine kind as its term is fitted and looked up (fitted_kind)."""
    return [replace(r, engine=fitted_kind(r.engine)) for r in rows]


def fitted_kind(engine: str) -> str:
    """The kind whose term an engine's rows are fitted for: an engine with bf16 weights, its
    family (bf16_family), since each way of updating them has too few runs of its own; any
    other, itself."""
    return bf16_family(engine) or engine


def refit(db_path: str | Path, results: Sequence[str | Path] = (),
          today: Any = None, kinds: Sequence[str] | None = None) -> dict[str, EngineTerm]:
    """Fit every engine kind on the bench results given plus the DB's recorded iterations,
    and store each term in the DB's `fits` table (replacing that kind's previous fit).
    `today` (perf.repredict.Repredictor on this DB): fit against the composed predictions of
    the surfaces in the DB now; a term fitted on the predictions the results recorded from
    older surfaces would correct the wrong model. `kinds`: store only these kinds' terms."""
    with ProfileDB.open(db_path, readonly=False) as db:
        rows = fitted_rows((rows_from_results(list(results), today) if results else [])
                           + rows_from_db(db, today))
        if not rows:
            raise EngineTermError(f"no profiled-model iteration rows in {list(map(str, results))} "
                                  f"nor in {db_path}'s iterations table; pass bench results JSON")
        terms = fit_engine_terms(rows)
        if kinds is not None:  # refit one engine without moving the others' terms
            unknown = set(kinds) - {r.engine for r in rows}
            if unknown:
                raise EngineTermError(f"engine kinds {sorted(unknown)} have no iteration rows; "
                                      f"the rows' kinds: {sorted({r.engine for r in rows})}")
            terms = {k: t for k, t in terms.items() if k in kinds}
        for term in terms.values():
            db.add_fit(term.to_fit())
    return terms


def stored_term(db: ProfileDB, engine: str | None) -> EngineTerm | None:
    """The DB's term for `engine`, or None (no engine kind given, or none fitted for it):
    its own, its bf16 family's, for an update the profile has not timed (UNPROFILED_UPDATES)
    the family of the update it varies (so that its prediction is that update's, and what it
    changes shows as the model's error), else its fp32 twin's."""
    if engine is None:
        return None
    fits = {f.name: f for f in db.fits()}
    fit = _term_fit(fits, engine)
    if fit is None and OVERLAPPED_SYNC in engine.split("+"):
        fit = _term_fit(fits, flat_twin(engine))
    return EngineTerm.from_fit(fit) if fit is not None else None


def _term_fit(fits: dict[str, Any], engine: str) -> Any:
    profiled = "+".join(p for p in engine.split("+") if p not in UNPROFILED_UPDATES)
    kinds = (engine, bf16_family(engine), bf16_family(profiled), term_engine(engine))
    return next((fits[FIT_PREFIX + k] for k in kinds if k and FIT_PREFIX + k in fits), None)


def flat_twin(engine: str) -> str:
    """An engine that sums gradients during the backward (OVERLAPPED_SYNC) as the one that
    sums the same flat buffers after it: the same per-step host work (a captured graph
    replays either), so it shares that term until rows of its own are fitted; what it hides
    is in the composed time (perf/base.py, exposed_allreduce_s)."""
    return "+".join("flat" if part == OVERLAPPED_SYNC else part for part in engine.split("+"))


def bf16_family(engine: str) -> str | None:
    """The fitted term an engine with bf16 weights takes before its fp32 twin's: its kind up
    to 'bf16-weights' (a tuned compile mode read as the default one), whichever way it
    updates them. Sharing the fp32 twin's term, every bf16 engine was predicted fast: median
    -2.8% over 53 bench rows on the H200 (fp32 rows -0.5%); one term for the family predicted
    runs it was not fitted on within 1.6% (BENCHMARKS.md, thirty-second session). None for
    an engine without bf16 weights."""
    parts = engine.split("+")
    if BF16_WEIGHTS not in parts:
        return None
    family = [*map(_untuned, parts[:parts.index(BF16_WEIGHTS) + 1])]
    return "+".join(family + [part for part in parts if part in UNPROFILED_UPDATES])


def _untuned(part: str) -> str:
    """An engine-kind part with a tuned compile mode read as the default one."""
    return "compile-default" if part.removeprefix("compile-") in TUNED_MODES else part


def term_engine(engine: str) -> str:
    """The engine kind whose fitted term `engine` shares where its own kind and its bf16
    family (bf16_family) have none: a tuned compile mode reads as the default one (tuning
    changes which kernels run, not the per-step host work that the term fits), and bf16
    weights, updated either way, as fp32 ones (the same launches; what they save or add is in
    the composed time: perf/profiled.py)."""
    return "+".join(_untuned(part) for part in engine.split("+")
                    if part not in (BF16_WEIGHTS, PER_WEIGHT_UPDATE, BF16_MOMENTS,
                                    NO_MAIN_WEIGHTS, *UNPROFILED_UPDATES))


def bf16_weights(engine: str | None) -> bool:
    """Whether an engine kind stores its GEMM weights in bf16 (engine/main_weights.py)."""
    return BF16_WEIGHTS in (engine or "").split("+")


def per_weight_update(engine: str | None) -> bool:
    """Whether an engine kind updates its bf16 weights a weight at a time."""
    return PER_WEIGHT_UPDATE in (engine or "").split("+")


def bf16_moments(engine: str | None) -> bool:
    """Whether an engine kind keeps its bf16 weights' AdamW moments in bf16."""
    return BF16_MOMENTS in (engine or "").split("+")


def no_main_weights(engine: str | None) -> bool:
    """Whether an engine kind keeps its bf16 weights without fp32 main copies."""
    return NO_MAIN_WEIGHTS in (engine or "").split("+")
