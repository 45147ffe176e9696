"""Planner benchmark: mosaic's search time and optimality on seeded synthetic graphs.

For each SM-share step and seed: mosaic's search time and predicted iteration time; the
reference optimum from the exhaustive search when it finishes within its budget, else the
best of a long GAHC run and a deep mosaic search (random restarts, every neighbour solved in
full) -- the best plan known, labelled as such; and GAHC's own ratio and time with and
without caching. optimality_ratio = reference time / mosaic time (1.0 = optimal; above 1
only when mosaic beats a non-exhaustive reference).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mosaic.files import atomic_path
from mosaic.graph import MMGraph
from mosaic.hardware import ClusterSpec, make_cluster
from mosaic.perf import AnalyticModel
from mosaic.perf.base import PerfModel
from mosaic.plan import PlanError
from mosaic.planners.exhaustive import ExhaustiveConfig, plan_exhaustive
from mosaic.planners.gahc import GAHCConfig, run_gahc
from mosaic.planners.mosaic import MosaicPlannerConfig, plan_mosaic
from mosaic.synthetic import synthetic_graph

PerfFactory = Callable[[ClusterSpec], PerfModel]


def bench_planner(num_modules: int, num_gpus: int, sm_steps: Sequence[float | None] = (None,),
                  seeds: Sequence[int] = (0, 1, 2), time_limit_s: float = 10.0,
                  exhaustive_time_limit_s: float = 60.0, gahc_generations: int = 150,
                  reference_time_limit_s: float = 30.0,
                  perf_factory: PerfFactory = AnalyticModel) -> list[dict[str, Any]]:
    """One row per SM step, aggregated over seeds (medians, worst case, per-seed details).

    Keys the CLI reads: search_time_s (median mosaic search), optimality_ratio (median) and
    worst_optimality_ratio (minimum over seeds).
    """
    cluster = make_cluster(num_gpus)
    rows = []
    for sm_step in sm_steps:
        runs = [_bench_seed(synthetic_graph(num_modules, seed, num_gpus=num_gpus), cluster,
                            perf_factory(cluster), sm_step, time_limit_s, exhaustive_time_limit_s,
                            gahc_generations, reference_time_limit_s) for seed in seeds]
        rows.append(_aggregate(num_modules, num_gpus, sm_step, runs))
    return rows


def _bench_seed(graph: MMGraph, cluster: ClusterSpec, perf: PerfModel, sm_step: float | None,
                time_limit_s: float, exhaustive_time_limit_s: float, gahc_generations: int,
                reference_time_limit_s: float) -> dict[str, Any]:
    start = time.perf_counter()
    plan = plan_mosaic(graph, cluster, perf, MosaicPlannerConfig(sm_step=sm_step, time_limit_s=time_limit_s))
    mosaic_s, search_s = plan.predicted_iteration_s, time.perf_counter() - start
    run: dict[str, Any] = {"seed": graph.meta.get("seed"), "mosaic_s": mosaic_s, "search_time_s": search_s,
                           "mosaic_evaluations": plan.meta["evaluations"]}
    run.update(_reference(graph, cluster, perf, sm_step, exhaustive_time_limit_s, reference_time_limit_s))
    for cached in (True, False):
        result = run_gahc(graph, cluster, perf, GAHCConfig(
            seed=0, generations=gahc_generations, use_cache=cached, sm_step=sm_step))
        tag = "gahc_cached" if cached else "gahc_uncached"
        run[f"{tag}_s"] = result.cost_s
        run[f"{tag}_time_s"] = result.search_time_s
        run[f"{tag}_evaluations"] = result.evaluations
    return run


def _reference(graph: MMGraph, cluster: ClusterSpec, perf: PerfModel, sm_step: float | None,
               exhaustive_time_limit_s: float, reference_time_limit_s: float) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        plan = plan_exhaustive(graph, cluster, perf, ExhaustiveConfig(
            sm_step=sm_step, time_limit_s=exhaustive_time_limit_s))
        return {"reference": "exhaustive", "reference_s": plan.predicted_iteration_s,
                "reference_time_s": time.perf_counter() - start}
    except PlanError as exc:
        refused = str(exc)
    start = time.perf_counter()
    long_gahc = run_gahc(graph, cluster, perf, GAHCConfig(
        seed=1, population=48, generations=10**9, sm_step=sm_step, time_limit_s=reference_time_limit_s))
    deep = plan_mosaic(graph, cluster, perf, MosaicPlannerConfig(
        sm_step=sm_step, restarts=8, restart_evaluations=10**9, screened=10**6,
        time_limit_s=reference_time_limit_s))
    return {"reference": "best of long gahc and deep mosaic",
            "reference_s": min(long_gahc.cost_s, deep.predicted_iteration_s),
            "reference_time_s": time.perf_counter() - start, "long_gahc_s": long_gahc.cost_s,
            "deep_mosaic_s": deep.predicted_iteration_s, "exhaustive_refused": refused}


def _aggregate(num_modules: int, num_gpus: int, sm_step: float | None,
               runs: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [r["reference_s"] / r["mosaic_s"] for r in runs]
    row: dict[str, Any] = {
        "num_modules": num_modules, "num_gpus": num_gpus, "sm_step": sm_step,
        "seeds": [r["seed"] for r in runs],
        "search_time_s": statistics.median(r["search_time_s"] for r in runs),
        "max_search_time_s": max(r["search_time_s"] for r in runs),
        "optimality_ratio": statistics.median(ratios), "worst_optimality_ratio": min(ratios),
        "reference": sorted({r["reference"] for r in runs}),
        "reference_time_s": statistics.median(r["reference_time_s"] for r in runs),
    }
    for tag in ("gahc_cached", "gahc_uncached"):
        row[f"{tag}_time_s"] = statistics.median(r[f"{tag}_time_s"] for r in runs)
        row[f"{tag}_evaluations"] = statistics.median(r[f"{tag}_evaluations"] for r in runs)
        row[f"{tag}_optimality_ratio"] = statistics.median(r["reference_s"] / r[f"{tag}_s"] for r in runs)
    row["runs"] = runs
    return row


def plot_bench(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Search time (log scale) and optimality ratio per configuration, mosaic vs GAHC."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['num_modules']}m/{r['num_gpus']}g\nstep {r['sm_step'] or 'gran'}" for r in rows]
    x = range(len(rows))
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(max(8.0, 0.9 * len(rows) + 4), 4))
    for key, name in (("search_time_s", "mosaic"), ("reference_time_s", "reference"),
                      ("gahc_cached_time_s", "GAHC cached"), ("gahc_uncached_time_s", "GAHC uncached")):
        ax_t.plot(x, [r[key] for r in rows], marker="o", label=name)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("search time (s)")
    for key, name in (("optimality_ratio", "mosaic median"), ("worst_optimality_ratio", "mosaic worst"),
                      ("gahc_cached_optimality_ratio", "GAHC median")):
        ax_r.plot(x, [r[key] for r in rows], marker="o", label=name)
    ax_r.axhline(0.97, color="grey", linestyle=":", linewidth=1)
    ax_r.set_ylabel("reference time / planner time")
    for ax in (ax_t, ax_r):
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("planner search time and optimality (synthetic OFASys-like graphs)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:  # never a truncated PNG under the requested name
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    return path
