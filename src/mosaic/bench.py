"""`mosaic bench` as one function, for the zoo and for a user's own modules alike: plan the
model with each planner, measure every plan and the user's own programs in one process
(`engine/measure.py`), and return the results JSON that `mosaic bench --json` prints.

graph + planners -> plans (made on rank 0, shared) -> measurements -> report. Collective:
under torchrun every rank calls `run_bench` with the same arguments and gets the same report
(step times are the slowest rank's); the caller writes it on rank 0.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mosaic.autotune import AutotuneResult, autotune_recorded
from mosaic.engine.measure import (
    BenchConfig,
    BenchError,
    BenchInterrupted,
    BenchStopped,
    GradientsDiffer,
    PlanMeasurement,
    bench_report,
    engine_variant,
    measure_plans,
    variant_applies,
    variant_label,
)
from mosaic.engine.session import EngineConfig
from mosaic.graph import MMGraph
from mosaic.hardware import ClusterSpec
from mosaic.perf.base import PerfModel
from mosaic.plan import Plan

log = logging.getLogger(__name__)

DEFAULT_PLANNERS = ("megatron", "distmm", "spindle", "mosaic")


@dataclass(slots=True)
class BenchRun:
    report: dict[str, Any]
    """The results JSON (`mosaic bench --json`): one row per plan and user program."""
    measurements: list[PlanMeasurement]
    autotune: AutotuneResult | None = None
    autotune_db: Path | None = None
    """Where autotune recorded its measurements (None: not recorded)."""
    interrupted: BenchInterrupted | None = None
    """Set when SIGTERM stopped the measurement: the report holds what was measured by then
    (`complete` false, `interrupted` says after which phase)."""
    refused: GradientsDiffer | None = None
    """Set when a contender's gradients differed from the reference's: the report holds the
    groups measured before and every contender's differences (`complete` false, `refused`
    names the contender and module)."""


def perf_model_for(name: str, cluster: ClusterSpec, preset: str, db: str | Path | None,
                   engine: EngineConfig) -> PerfModel:
    """The named performance model, predicting for the engine kind `engine` runs (its
    kernels' surfaces and its fitted per-step term)."""
    from mosaic.perf import make_perf_model
    from mosaic.perf.engine_term import engine_kind

    if db is not None and name == "analytic":
        raise BenchError("--profile-db is read by the profiled model; drop --perf-model "
                         "analytic (or --profile-db)")
    return make_perf_model(name, cluster, preset=preset, db=db,
                           engine=engine_kind(dataclasses.asdict(engine), cluster.num_gpus),
                           accumulation=engine.accumulation)


def run_bench(model: Any, graph: MMGraph, cluster: ClusterSpec, config: BenchConfig, *,
              preset: str | None = None, planners: Sequence[str] = DEFAULT_PLANNERS,
              perf_model: str = "auto", profile_db: str | Path | None = None,
              plans: Mapping[str, Plan] | Callable[[], Mapping[str, Plan]] | None = None,
              variants: Sequence[dict[str, Any]] = (), autotune: int = 0,
              autotune_skip: Sequence[str] = ()) -> BenchRun:
    """Measure `planners`' plans of `graph` (or the given `plans`, predicted here; a callable
    giving them runs on rank 0 only, its error raised on every rank) and the user programs
    of `config`. `variants`: engine settings to measure the plans again with
    (labelled PLAN@SETTINGS); `autotune` K: add the fastest of the K best predicted plans and
    the baselines, measured briefly, as plan `autotune` (`autotune_skip`: planners left out of
    its candidates)."""
    import torch

    from mosaic.engine.comm import share_from_rank0
    from mosaic.engine.session import end_distributed, start_distributed
    from mosaic.planners import plan_all

    preset = preset or graph.preset
    cpu = not torch.cuda.is_available()
    if cpu and config.engine.amp is None and any(s.get("bf16_weights") for s in variants):
        # bf16 weights run under autocast; on a CPU (where it is off by default) the other
        # plans and the reference must too, or the gradient check compares bf16 with fp32
        config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, amp=True))
    # Predicted for the engine as it will run here: no CUDA graphs on a CPU (measure_plans).
    ran = dataclasses.replace(config.engine, graphs=False) if cpu else config.engine
    perf = perf_model_for(perf_model, cluster, preset, profile_db, ran)
    for settings in variants:  # a bad variant is refused before planning and set-up
        engine_variant(config.engine, settings)

    def make_plans() -> dict[str, Any]:
        given = plans() if callable(plans) else plans
        chosen = ({k: perf.predict(p, graph) for k, p in given.items()} if given is not None
                  else {p.planner: p for p in plan_all(graph, cluster, perf, list(planners))})
        chosen |= _variant_plans(chosen, variants, config.engine, perf_model, cluster, graph,
                                 preset, profile_db)
        return {k: p.to_dict() for k, p in chosen.items()}

    d = start_distributed(None)
    try:
        measured = {k: Plan.from_dict(v) for k, v in share_from_rank0(make_plans, d.device).items()}
        engines = {variant_label(k, s): engine_variant(config.engine, s)
                   for s in variants for k in measured if variant_label(k, s) in measured}
        tuned, tuned_db = (autotune_recorded(model, preset, graph, cluster, perf, autotune,
                                             config.engine, cpu=d.device.type == "cpu",
                                             skip=autotune_skip)
                           if autotune else (None, None))
        if tuned is not None:
            measured["autotune"] = tuned.plan
        stopped = None
        try:
            measurements, checks = measure_plans(model, preset, graph, measured, cluster.gpu,
                                                 config, engines)
        except BenchStopped as stop:
            stopped, measurements, checks = stop, stop.measurements, stop.checks
    finally:
        end_distributed(d)
    report = _report(graph, measurements, cluster, preset, perf, checks, tuned, config)
    report["complete"] = stopped is None
    if stopped is not None:
        key, entry = stopped.report_entry()
        report[key] = entry
    return BenchRun(report, measurements, tuned, tuned_db,
                    stopped if isinstance(stopped, BenchInterrupted) else None,
                    stopped if isinstance(stopped, GradientsDiffer) else None)


def _report(graph: MMGraph, measurements: list[PlanMeasurement], cluster: ClusterSpec,
            preset: str, perf: PerfModel, checks: dict[str, Any], tuned: AutotuneResult | None,
            config: BenchConfig) -> dict[str, Any]:
    report = bench_report(graph, measurements, cluster.gpu, preset, cluster.num_gpus)
    report["perf_model"] = perf.describe()
    report["checks"] = checks
    if tuned is not None:
        report["autotune"] = tuned.to_dict()
    engine = config.engine
    report["engine"] = {"graphs": engine.graphs, "compile": engine.compile,
                        "compile_scope": engine.compile_scope, "grad_sync": engine.grad_sync,
                        "reduce_dtype": engine.reduce_dtype,
                        "grads_in_graph": engine.grads_in_graph,
                        "accumulation": engine.accumulation}
    return report


def _variant_plans(plans: dict[str, Plan], variants: Sequence[dict[str, Any]],
                   base: EngineConfig, perf_model: str, cluster: ClusterSpec, graph: MMGraph,
                   preset: str, profile_db: str | Path | None) -> dict[str, Plan]:
    """For each engine variant, every plan it changes again under its label PLAN@SETTINGS,
    predicted for the engine kind it will run on."""
    added = {}
    for settings in variants:
        model = perf_model_for(perf_model, cluster, preset, profile_db,
                               engine_variant(base, settings))
        added |= {variant_label(k, settings): model.predict(p, graph)
                  for k, p in plans.items() if variant_applies(p, settings)}
    if variants and not added:
        log.warning("these engine variants change gradient synchronisation, and no plan here "
                    "is data-parallel: nothing to vary")
    return added
