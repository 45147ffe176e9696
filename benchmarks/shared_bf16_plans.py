"""Which plans, measured together on one bf16 copy of the modules (as `mosaic train
--bf16-weights --autotune K` measures its candidates), make a cuBLAS GEMM fail?

On the H200 (2026-12-03) OFASys `paper` b8's autotune stopped in its first step: the
`structured` encoder's first GEMM failed (`CUBLAS_STATUS_EXECUTION_FAILED`, compiled or
eager, also with launches made blocking), while the planner's plan alone trained. One run
of this script measures one set of plans on the shared copy, briefly, and prints either
their medians or the error; run it once per set (a CUDA error ends the process's use of
the GPU):

    PYTHONPATH=src python benchmarks/shared_bf16_plans.py ofasys paper 8 mosaic,megatron \
        [--per-weight mosaic] [--compile none] [--fp32] [--out OUT.json]

The eighteenth session found the failing plan: gahc's, alone, fp32 weights too (its seven
encoders share one `free` stage; mosaic's plan caps two of them with green contexts and
trains). The plan's shape can be varied to find what in it fails: `--no-graphs`,
`--priority 0` (no high-priority stream), `--concurrent MODS` (only these stay in the
concurrent stage, the others run one by one before it), `--no-cudnn`.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from dataclasses import replace

from mosaic.autotune import PER_WEIGHT_UPDATE
from mosaic.engine.measure import BenchConfig, measure_plans, variant_label
from mosaic.engine.session import EngineConfig
from mosaic.hardware import make_cluster
from mosaic.perf import make_perf_model
from mosaic.plan import Plan, Stage
from mosaic.planners import plan_all
from mosaic.zoo import get_model


def reshaped(plan: Plan, priority: int | None, concurrent: str) -> Plan:
    """`plan` with every stream at `priority` (None: as planned) and, when `concurrent` names
    modules, each concurrent stage cut down to those, its other modules one by one before."""
    keep = set(filter(None, concurrent.split(",")))
    stages = []
    for stage in plan.stages:
        placements = tuple(p if priority is None else replace(p, priority=priority)
                           for p in stage.placements)
        if keep and stage.sharing != "temporal":
            stages += [Stage(placements=(p,), sharing="temporal") for p in placements
                       if p.module not in keep]
            placements = tuple(p for p in placements if p.module in keep)
        if placements:
            stages.append(Stage(placements=placements, sharing=stage.sharing))
    return replace(plan, stages=tuple(stages))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("preset")
    parser.add_argument("batch", type=int)
    parser.add_argument("planners", help="comma-separated planners whose plans share the copy")
    parser.add_argument("--per-weight", default="", help="planners also measured updating a "
                        "weight at a time (bf16_flat_grads=false), as autotune's candidate")
    parser.add_argument("--compile", default="default", help="Inductor mode, or none")
    parser.add_argument("--scope", default="module", help="compile scope: module | blocks")
    parser.add_argument("--fp32", action="store_true", help="fp32 weights under autocast "
                        "instead (is it bf16 weights at all?)")
    parser.add_argument("--no-graphs", action="store_true", help="eager steps, no CUDA graphs")
    parser.add_argument("--priority", type=int, choices=(0, 1), help="every stream at this "
                        "priority instead of the plan's")
    parser.add_argument("--concurrent", default="", help="comma-separated modules kept in "
                        "each concurrent stage; the stage's others run one by one before it")
    parser.add_argument("--no-cudnn", action="store_true", help="convolutions without "
                        "cuDNN (torch.backends.cudnn.enabled = False)")
    parser.add_argument("--out", help="JSON file for the result")
    args = parser.parse_args()
    if args.no_cudnn:
        import torch

        torch.backends.cudnn.enabled = False

    model = get_model(args.model)
    graph = model.graph(args.preset, global_batch=args.batch)
    cluster = make_cluster(1, "h200")
    perf = make_perf_model("auto", cluster, preset=args.preset)
    plans = {p.planner: reshaped(p, args.priority, args.concurrent)
             for p in plan_all(graph, cluster, perf, args.planners.split(","))}
    engine = EngineConfig(graphs=not args.no_graphs, compile=None if args.compile == "none" else args.compile,
                          compile_scope=args.scope, bf16_weights=not args.fp32)
    engines = {}
    for planner in filter(None, args.per_weight.split(",")):
        label = variant_label(planner, PER_WEIGHT_UPDATE)
        plans[label] = plans[planner]
        engines[label] = replace(engine, **PER_WEIGHT_UPDATE)
    config = BenchConfig(rounds=2, steps_per_round=3, warmup_steps=2, engine=engine,
                         user_programs=(), nvml_seconds=0.0)
    result = {"model": args.model, "preset": args.preset, "batch": args.batch,
              "plans": list(plans), "compile": args.compile, "scope": args.scope,
              "weights": "fp32" if args.fp32 else "bf16", "graphs": not args.no_graphs,
              "priority": args.priority, "concurrent": args.concurrent,
              "cudnn": not args.no_cudnn,
              "stages": {k: [[s.sharing, *s.modules] for s in p.stages]
                         for k, p in plans.items()}}
    start = time.perf_counter()
    try:
        measured, _ = measure_plans(model, args.preset, graph, plans, cluster.gpu, config,
                                    engines)
        result["median_ms"] = {m.label: m.median_s * 1e3 for m in measured}
    except RuntimeError as exc:  # the question is which sets fail: keep the answer
        result["error"] = str(exc).splitlines()[0]
        result["where"] = traceback.format_exc().splitlines()[-12:]
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps({k: v for k, v in result.items() if k != "where"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
