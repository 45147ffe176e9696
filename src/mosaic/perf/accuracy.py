"""Model error on held-out measurements (the reviewer's question: MAPE on unseen colocations).

- Single modules: leave-one-out over every measured point except the four corners of each
  module's (batch, SMs) box (those stay, so held-out points are interpolations, as planning
  queries are). The surface is refitted without the point, then predicts it.
- Colocations: k-fold, stratified by sharing mode, in record order (deterministic). The interference coefficients are fitted
  on the other folds (with the measured alone times) and predict the held-out groups end to
  end from the surfaces, as the planner would. Surfaces never see colocation data.
- Reference rows: the analytic model as is, and times the DB's mean calibration factor.
- The fallback for modules missing from the DB (`fallback_held_out`): leave one module out,
  calibrate on the others, predict the module's points; per module the median error, for the
  nearest-points calibration the model uses and for one global factor.
- Whole iterations (`iteration_error`): every plan row of `mosaic bench` results JSON, the
  plan's predicted iteration time against its measured median, gated against the targets.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from mosaic.hardware import ClusterSpec, make_cluster
from mosaic.perf.base import Work
from mosaic.perf.interference import VARIANTS, CoSample, fit_interference, group_time_s
from mosaic.perf.profiled import (
    SurfaceSet,
    drift_finding,
    fit_surface,
    held_out_errors,
    interference_choice_name,
    interference_fit_name,
)
from mosaic.perf.results import bench_result_files, load_bench_result, superseded_labels
from mosaic.profile.db import ColocPoint, FitRecord, ModulePoint, ProfileDB, colocation_kernels


def _ape(pred: float, meas: float) -> float:
    return 100.0 * abs(pred / meas - 1.0)


def single_errors(surfaces: SurfaceSet) -> list[dict[str, Any]]:
    """Leave-one-out errors of the scaling surfaces on non-corner points."""
    rows = []
    for sig, pts in sorted(surfaces.points.items()):
        if len(pts) < 6:
            continue
        bs, ks = [p.per_gpu_batch for p in pts], [p.num_sms for p in pts]
        corners = {(b, k) for b in (min(bs), max(bs)) for k in (min(ks), max(ks))}
        for i, p in enumerate(pts):
            if (p.per_gpu_batch, p.num_sms) in corners:
                continue
            rest: list[ModulePoint] = pts[:i] + pts[i + 1:]
            pred = float(fit_surface(rest, surfaces.gpu.num_sms).predict(p.per_gpu_batch, p.num_sms)[0])
            rows.append({"signature": sig, "per_gpu_batch": p.per_gpu_batch,
                         "num_sms": p.num_sms, "measured_s": p.time_s, "predicted_s": pred,
                         "ape": _ape(pred, p.time_s)})
    return rows


def _folds(colocs: Sequence[ColocPoint], folds: int) -> list[int]:
    """Fold of each record, stratified by sharing mode (every fold sees every mode)."""
    seen: dict[str, int] = {}
    out = []
    for c in colocs:
        out.append(seen.get(c.sharing, 0) % folds)
        seen[c.sharing] = seen.get(c.sharing, 0) + 1
    return out


def coloc_errors(surfaces: SurfaceSet, colocs: Sequence[ColocPoint], variant: str,
                 folds: int = 3, measured_alone: bool = False) -> list[dict[str, Any]]:
    """k-fold held-out group-time errors of one interference variant; the held-out members'
    alone times from their surfaces (the model's whole error), or as measured beside the
    colocation (`measured_alone`: the interference term's error alone)."""
    train = [surfaces.sample(c, use_measured_alone=True) for c in colocs]
    test = [surfaces.sample(c, use_measured_alone=measured_alone) for c in colocs]
    fold_of = _folds(colocs, folds)
    rows = []
    for fold in sorted(set(fold_of)):
        fit_on: list[CoSample] = [s for s, f in zip(train, fold_of, strict=True)
                                  if f != fold and s is not None]
        params = fit_interference(fit_on, variant)
        for c, s, f in zip(colocs, test, fold_of, strict=True):
            if f != fold or s is None:
                continue
            pred = group_time_s(params, s.works, s.sharing)
            rows.append({"id": c.id, "model": c.model, "sharing": c.sharing,
                         "modules": [w.module for w in c.works], "measured_s": c.group_time_s,
                         "predicted_s": pred, "ape": _ape(pred, c.group_time_s)})
    return rows


def _analytic_rows(surfaces: SurfaceSet, colocs: Sequence[ColocPoint],
                   scale: float) -> tuple[list[float], list[float]]:
    model, gpu = surfaces.analytic, surfaces.gpu
    single = [_ape(scale * model.module_time_s(surfaces.specs[sig], p.per_gpu_batch,
                                               p.num_sms / gpu.num_sms), p.time_s)
              for sig, pts in surfaces.points.items() if sig in surfaces.specs for p in pts]
    coloc = []
    for c in colocs:
        if any(w.signature not in surfaces.specs for w in c.works):
            continue
        works = [Work(surfaces.specs[w.signature], w.per_gpu_batch, w.num_sms / gpu.num_sms,
                      w.priority) for w in c.works]
        coloc.append(_ape(scale * model.colocated_time_s(works, c.sharing), c.group_time_s))
    return single, coloc


def _summary(single: Sequence[float], coloc: Sequence[float]) -> dict[str, Any]:
    def mean(xs: Sequence[float]) -> float | None:
        return float(np.mean(xs)) if len(xs) else None

    return {"single_mape": mean(single), "coloc_mape": mean(coloc),
            "worst_error": max([*single, *coloc], default=None),
            "n_points": {"single": len(single), "coloc": len(coloc)}}


def model_error(db: ProfileDB | str | Path, cluster: ClusterSpec | None = None, *,
                folds: int = 3, details: bool = False, kernels: str = "eager") -> dict[str, Any]:
    """Held-out errors (percent) of the profiled model's variants and the analytic reference,
    on the colocations measured with `kernels` (eager, or a compiled engine's)."""
    owned = not isinstance(db, ProfileDB)
    db = ProfileDB.open(db) if owned else db
    try:
        cluster = cluster or make_cluster(1, db.hardware)
        surfaces = SurfaceSet.from_db(db, cluster, prefer=kernels)
        colocs = surfaces.colocations_of(db.colocations(), kernels)
        path = str(db.path)
    finally:
        if owned:
            db.close()
    single = single_errors(surfaces)
    single_ape = [r["ape"] for r in single]
    result: dict[str, Any] = {"db": path, "hardware": cluster.gpu.name, "folds": folds,
                              "kernels": kernels, "calibration": surfaces.calibration, "rows": {}}
    for variant in VARIANTS:
        rows = coloc_errors(surfaces, colocs, variant, folds)
        summary = _summary(single_ape, [r["ape"] for r in rows])
        summary["coloc_by_mode"] = _by_mode(rows)
        if details:
            summary["coloc_points"] = rows
        result["rows"][f"profiled-{variant}"] = summary
    for name, scale in (("analytic", 1.0), ("analytic-calibrated", surfaces.calibration)):
        result["rows"][name] = _summary(*_analytic_rows(surfaces, colocs, scale))
    result["fallback_held_out"] = fallback_held_out(surfaces)
    result["surface_drift"] = surfaces.drift(colocs)
    if details:
        result["single_points"] = single
    return result


def drift_advice(drift: Sequence[dict[str, Any]], kernels: str) -> list[str]:
    """One line per suspect surface (SurfaceSet.drift), with the command that measures it
    again."""
    return [f"{d['model']} {d['module']} (`{d['preset']}`): {drift_finding(d, kernels)}"
            for d in drift]


def stale_surface_advice(db_path: str | Path, hardware: str, kernels: str) -> list[str]:
    """drift_advice for the DB's colocations measured with `kernels` (`mosaic profile` prints
    it after measuring colocations)."""
    with ProfileDB.open(db_path) as db:
        surfaces = SurfaceSet.from_db(db, make_cluster(1, hardware), prefer=kernels)
        drift = surfaces.drift(surfaces.colocations_of(db.colocations(), kernels))
    return drift_advice(drift, kernels)


def fallback_held_out(surfaces: SurfaceSet) -> dict[str, Any]:
    """Leave-one-module-out error of the analytic fallback, for the nearest-points calibration
    and for one global factor: median and worst over modules of each module's median |error|,
    and the way the model uses."""
    per_module = held_out_errors(surfaces.calibration_points())
    out: dict[str, Any] = {"modules": len(per_module), "used": "nearest" if
                           surfaces.fallback.nearest else "global"}
    for how in ("nearest", "global"):
        errors = [e[how] for e in per_module.values()]
        out[how] = ({"median_pct": float(np.median(errors)), "worst_pct": float(np.max(errors))}
                    if errors else None)
    return out


def store_interference_fits(db_path: str | Path, hardware: str, kernels: str = "eager",
                            held_out: dict[str, Any] | None = None) -> int:
    """Fit every interference variant on all colocations measured with `kernels` and store
    the coefficients in the DB (`fits`, named by profiled.interference_fit_name), beside their
    held-out MAPE when `held_out` (a model_error result for those kernels) gives it, so a
    model built later reads them instead of fitting on load; for compiled kernels, also which
    colocations the model fits on (interference_choice). Returns the colocations used."""
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    with ProfileDB.open(db_path, readonly=False) as db:
        surfaces = SurfaceSet.from_db(db, make_cluster(1, hardware), prefer=kernels)
        colocs = surfaces.colocations_of(db.colocations(), kernels)
        samples = [s for s in map(surfaces.sample, colocs) if s is not None]
        for variant in VARIANTS if samples else ():
            row = (held_out or {}).get("rows", {}).get(f"profiled-{variant}", {})
            db.add_fit(FitRecord(name=interference_fit_name(variant, kernels),
                                 params=asdict(fit_interference(samples, variant)),
                                 mape=row.get("coloc_mape"), n_points=len(samples), created=now))
        eager = surfaces.colocations_of(db.colocations(), "eager")
        if kernels != "eager" and samples and eager:
            choice = interference_choice(surfaces, colocs, eager)
            db.add_fit(FitRecord(name=interference_choice_name(kernels), params=choice,
                                 mape=choice[f"{choice['kernels']}_mape"],
                                 n_points=len(samples), created=now))
    return len(samples)


def interference_choice(surfaces: SurfaceSet, own: Sequence[ColocPoint],
                        eager: Sequence[ColocPoint], variant: str = "aware",
                        folds: int = 3) -> dict[str, Any]:
    """Which colocations a model of compiled kernels fits its interference on: their own, or
    the eager ones, whichever predicts their own colocations better held out. Held out by
    model where they span several (plans are predicted for models the fit has not seen; k
    folds mixing one model's colocations favour the fit made on it), else k-fold; neither fit
    sees the held-out model's colocations. Alone times as measured beside each colocation, so
    that a stale surface does not decide between two interference fits."""
    models = sorted({c.model for c in own})
    fold_of = ([models.index(c.model) for c in own] if len(models) > 1
               else _folds(own, folds))
    errors: dict[str, list[float]] = {"eager": [], "own": []}
    for fold in sorted(set(fold_of)):
        held = [c for c, f in zip(own, fold_of, strict=True) if f == fold]
        unseen = {c.model for c in held} if len(models) > 1 else set()
        fits = {"eager": [c for c in eager if c.model not in unseen],
                "own": [c for c, f in zip(own, fold_of, strict=True) if f != fold]}
        for kind, train in fits.items():
            params = fit_interference([x for x in map(surfaces.sample, train) if x is not None],
                                      variant)
            for c in held:
                x = surfaces.sample(c, use_measured_alone=True)
                if x is not None:
                    errors[kind].append(_ape(group_time_s(params, x.works, x.sharing),
                                             c.group_time_s))
    own_kernels = surfaces.colocation_kernels(own[0])
    scores = {kind: float(np.mean(apes)) if apes else float("inf")
              for kind, apes in errors.items()}
    return {"kernels": "eager" if scores["eager"] <= scores["own"] else own_kernels,
            "variant": variant, "held_out_by": "model" if len(models) > 1 else f"{folds} folds",
            "eager_mape": scores["eager"], f"{own_kernels}_mape": scores["own"],
            "own_colocations": len(own), "eager_colocations": len(eager)}


def kernels_with_colocations(db: ProfileDB | str | Path) -> list[str]:
    """The kernel kinds (eager first) of which the DB holds colocations."""
    owned = not isinstance(db, ProfileDB)
    db = ProfileDB.open(db) if owned else db
    try:
        kernels = {r.signature: r.kernels for r in db.modules()}
        kinds = {colocation_kernels(c, kernels) for c in db.colocations()} - {None}
    finally:
        if owned:
            db.close()
    return sorted(kinds, key=lambda k: (k != "eager", k))


def _by_mode(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    modes: dict[str, list[float]] = {}
    for r in rows:
        modes.setdefault(r["sharing"], []).append(r["ape"])
    return {m: float(np.mean(v)) for m, v in sorted(modes.items())}


def print_model_error(result: dict[str, Any], console: Any = None) -> None:
    """A rich table: one row per model variant, held-out MAPE and worst error."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=140)
    table = Table(title=f"model error on held-out points ({result['hardware']}, {result['db']}; "
                        f"{result.get('kernels', 'eager')} colocations)")
    for col in ("model", "single MAPE %", "coloc MAPE %", "worst %", "points (single/coloc)",
                "coloc MAPE by mode %"):
        table.add_column(col, justify="left" if col.startswith(("model", "coloc MAPE by")) else "right")

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    for name, r in result["rows"].items():
        modes = ", ".join(f"{m} {v:.1f}" for m, v in r.get("coloc_by_mode", {}).items())
        n = r["n_points"]
        table.add_row(name, pct(r["single_mape"]), pct(r["coloc_mape"]), pct(r["worst_error"]),
                      f"{n['single']}/{n['coloc']}", modes)
    console.print(table)
    console.print(f"calibration (measured / analytic, geometric mean): {result['calibration']:.3g}")
    held = result.get("fallback_held_out") or {}
    if held.get("nearest"):
        console.print(f"fallback for unprofiled modules, leave-one-module-out over "
                      f"{held['modules']} modules: nearest points median "
                      f"{held['nearest']['median_pct']:.1f}% (worst {held['nearest']['worst_pct']:.0f}%), "
                      f"one global factor {held['global']['median_pct']:.1f}% "
                      f"(worst {held['global']['worst_pct']:.0f}%); the model uses {held['used']}")
    for line in drift_advice(result.get("surface_drift", []), result.get("kernels", "eager")):
        console.print(line)


# --- whole iterations: predicted vs measured in `mosaic bench` results -------------------------

ITERATION_MAX_ERROR = 0.10
"""Target: every plan's predicted iteration time within 10% of its measured median."""
ITERATION_MEDIAN_ERROR = 0.05
"""Target: the median |error| over all predicted plan rows at most 5%."""


def _iteration_rows(name: str, report: dict[str, Any], repredict: Any = None,
                    path: Path | None = None) -> list[dict[str, Any]]:
    """One row per measured plan; a row without a prediction (user-program baselines such as
    torch-eager / torch-compile) keeps predicted_s and error None and stays out of the gate,
    as does every superseded row (the results file at `path`: results.superseded)."""
    rows = []
    replaced = superseded_labels(path) if path else lambda label: None
    for r in report["results"]:
        if not isinstance(r, dict) or not r.get("measured_iteration_s"):
            continue
        measured = float(r["measured_iteration_s"])
        recorded = float(r["predicted_iteration_s"]) if r.get("predicted_iteration_s") else None
        # A row today's model cannot place (no plan in it, a GPU mosaic has no spec for)
        # keeps the prediction it recorded.
        predicted = (repredict.predict(report, r) if repredict is not None else None) or recorded
        rows.append({"file": name, "model": report.get("model"), "preset": report.get("preset"),
                     "gpus": report.get("gpus"), "global_batch": report.get("global_batch"),
                     "planner": r.get("planner"), "predicted_s": predicted, "measured_s": measured,
                     "error": None if predicted is None else predicted / measured - 1,
                     "superseded": replaced(r.get("planner"))})
    return rows


def _gate(rows: Sequence[dict[str, Any]], max_error: float, median_error: float) -> dict[str, Any]:
    gated = [r for r in rows if r["error"] is not None and not r.get("superseded")]
    errors = [abs(r["error"]) for r in gated]
    if not errors:  # nothing predicted: nothing shows the model is accurate
        return {"count": 0, "median_abs_error": None, "max_abs_error": None,
                "share_within_max_error": None, "over_max_error": 0, "worst": None,
                "passed": False}
    median, worst = float(np.median(errors)), max(gated, key=lambda r: abs(r["error"]))
    within = sum(e <= max_error for e in errors)
    return {"count": len(errors), "median_abs_error": median, "max_abs_error": max(errors),
            "share_within_max_error": within / len(errors), "over_max_error": len(errors) - within,
            "worst": worst, "passed": max(errors) <= max_error and median <= median_error}


def iteration_error(paths_or_dir: str | Path | Iterable[str | Path], *,
                    max_error: float = ITERATION_MAX_ERROR,
                    median_error: float = ITERATION_MEDIAN_ERROR,
                    repredict: Any = None) -> dict[str, Any]:
    """Whole-iteration prediction error of every plan row in bench results (fractions, signed:
    predicted / measured - 1), with the gate: every |error| <= max_error, median <= median_error.
    `repredict` (a perf.repredict.Repredictor): judge today's model, not the predictions the
    results recorded when they were measured.
    """
    rows: list[dict[str, Any]] = []
    files = bench_result_files(paths_or_dir)
    for name, path in files:
        rows += _iteration_rows(name, load_bench_result(path) or {"results": []}, repredict,
                                path)
    return {"files": [name for name, _ in files],
            "predictions": "recorded" if repredict is None else "today's model",
            "targets": {"max_abs_error": max_error, "median_abs_error": median_error},
            "rows": rows, "not_predicted": sum(r["error"] is None for r in rows),
            "superseded": sum(bool(r["superseded"]) and r["error"] is not None for r in rows),
            "by_gpus": {n: _gate([r for r in rows if r["gpus"] == n], max_error, median_error)
                        for n in sorted({r["gpus"] for r in rows if r["gpus"]})},
            **_gate(rows, max_error, median_error)}


def gate_summary(result: dict[str, Any]) -> str:
    """One line: PASS/FAIL and the figures behind it (plain text, for tables and Markdown)."""
    t = result["targets"]
    if not result["count"]:
        return f"FAIL: no predicted plan rows ({result['not_predicted']} not predicted)"
    w = result["worst"]
    return (f"{'PASS' if result['passed'] else 'FAIL'}: {result['count']} predicted plan rows, "
            f"median |error| {result['median_abs_error']:.1%} "
            f"(target <= {t['median_abs_error']:.0%}), "
            f"max {result['max_abs_error']:.1%} (target <= {t['max_abs_error']:.0%}; "
            f"{w['model']} {w['planner']}, {w['file']}), "
            f"{result['share_within_max_error']:.0%} within {t['max_abs_error']:.0%}; "
            f"{result['not_predicted']} rows not predicted (excluded)"
            + (f", {result['superseded']} rows of superseded runs (excluded; their reruns "
               f"are gated)" if result.get("superseded") else "")
            + _by_gpus(result.get("by_gpus") or {}))


def _by_gpus(by_gpus: dict[int, dict[str, Any]]) -> str:
    """The gate per GPU count, where results span several: which hardware a miss needs."""
    if len(by_gpus) < 2:
        return ""
    parts = [f"{n} GPU{'s' if n > 1 else ''} {'PASS' if g['passed'] else 'FAIL'} "
             f"({g['count']} rows, median {g['median_abs_error']:.1%}, max "
             f"{g['max_abs_error']:.1%})" for n, g in by_gpus.items() if g["count"]]
    return "; by GPU count: " + ", ".join(parts)


def print_iteration_error(result: dict[str, Any], console: Any = None) -> None:
    """A rich table: one row per measured plan, then the gate verdict in bold."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=160)
    verdict = "[bold green]PASS[/]" if result["passed"] else "[bold red]FAIL[/]"
    table = Table(title=f"whole-iteration prediction error: {verdict}")
    for col in ("file", "model", "preset", "gpus", "batch", "planner", "predicted ms",
                "measured ms", "error"):
        numeric = col.endswith(("ms", "error", "gpus", "batch"))
        table.add_column(col, justify="right" if numeric else "left")
    limit = result["targets"]["max_abs_error"]
    for r in result["rows"]:
        if r["error"] is None:
            predicted, error = "-", "not predicted"
        elif r["superseded"]:
            predicted = f"{r['predicted_s'] * 1e3:.2f}"
            error = f"[dim]{r['error'] * 100:+.1f}% superseded[/]"
        else:
            predicted = f"{r['predicted_s'] * 1e3:.2f}"
            style = "red" if abs(r["error"]) > limit else "green"
            error = f"[{style}]{r['error'] * 100:+.1f}%[/]"
        table.add_row(r["file"], str(r["model"]), str(r["preset"]), str(r["gpus"]),
                      str(r["global_batch"]), str(r["planner"]), predicted,
                      f"{r['measured_s'] * 1e3:.2f}", error)
    console.print(table)
    style = "bold green" if result["passed"] else "bold red"
    console.print(gate_summary(result), style=style, markup=False)
