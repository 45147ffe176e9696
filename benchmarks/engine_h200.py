"""ImageBind on one GPU: step time of temporal execution and of every sharing mode.

    PYTHONPATH=src python benchmarks/engine_h200.py --out results/engine_h200

Every mode trains the same modules with the same optimizer in one process, on the same batch,
interleaved in rounds whose order rotates, so clock or thermal drift cannot favour one mode;
each mode's number is the median (p10, p90) of rounds x steps-per-round steps after warm-up.
A step is forward + backward of every module + the AdamW step, timed with CUDA events.
Per-module CUDA graphs are on by default (eager PyTorch is launch-bound, DESIGN.md).

Self-checks (exit 1 when one fails): at identical weights, every mode's loss equals the
temporal one within bf16 tolerance, eagerly and again after the graphs are captured; losses
stay finite. A mode whose SM quotas could not be enforced is flagged in the table.

Modes (encoders colocated in stage 0, then the contrastive head; SM counts for 132 SMs):
  temporal       vision, audio, text one after another, whole GPU each
  partition-2    vision 80 | audio 48 SMs disjoint; text after them alone
  partition-3    vision 72 | audio 32 | text 16 SMs disjoint (DESIGN.md's split)
  cap            vision uncapped, audio capped at 64, text at 32 SMs (overlapping)
  free           three concurrent streams, no quota
  free-priority  free, vision's stream at high priority (the critical path)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from mosaic.engine.measure import (
    BenchConfig,
    BenchError,
    PlanMeasurement,
    environment,
    measure_plans,
)
from mosaic.engine.session import EngineConfig
from mosaic.graph import MMGraph
from mosaic.hardware import gpu_spec, make_cluster
from mosaic.plan import Placement, Plan, Stage

ENCODERS = ("vision", "audio", "text")
HEAD = "align"


def _stage(sharing: str, sms: dict[str, int], num_sms: int, priority: str = "") -> Stage:
    return Stage(sharing=sharing, placements=tuple(
        Placement(module=m, gpus=(0,), sm_share=min(1.0, n / num_sms), priority=int(m == priority))
        for m, n in sms.items()))


def mode_plans(graph: MMGraph, num_sms: int) -> dict[str, Plan]:
    full = num_sms
    head = _stage("temporal", {HEAD: full}, num_sms)
    stages = {
        "temporal": [_stage("temporal", dict.fromkeys(ENCODERS, full), num_sms)],
        "partition-2": [_stage("partition", {"vision": 80, "audio": 48}, num_sms),
                        _stage("temporal", {"text": full}, num_sms)],
        "partition-3": [_stage("partition", {"vision": 72, "audio": 32, "text": 16}, num_sms)],
        "cap": [_stage("cap", {"vision": full, "audio": 64, "text": 32}, num_sms)],
        "free": [_stage("free", dict.fromkeys(ENCODERS, full), num_sms)],
        "free-priority": [_stage("free", dict.fromkeys(ENCODERS, full), num_sms, "vision")],
    }
    cluster = make_cluster(1, "h200")
    return {name: Plan(model=graph.name, planner=f"bench-{name}", num_gpus=1,
                       stages=(*s, head)).validate(graph, cluster)
            for name, s in stages.items()}


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for engine_h200.json")
    p.add_argument("--model", default="imagebind")
    p.add_argument("--preset", default="small")
    p.add_argument("--global-batch", type=int, default=None)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps-per-round", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5, help="steps per mode before timing")
    p.add_argument("--modes", default=None, help="comma-separated subset (temporal is always run)")
    p.add_argument("--no-graphs", action="store_true", help="eager (launch-bound) instead")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run the same code on CPU (eager, timings meaningless): a logic check")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    gpu = gpu_spec("h200")
    args.no_graphs = args.no_graphs or args.cpu_smoke
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("engine_h200: needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    from mosaic.zoo import get_model

    model = get_model(args.model)
    graph = model.graph(args.preset, args.global_batch)
    plans = mode_plans(graph, gpu.num_sms)
    if args.modes:
        wanted = {"temporal", *args.modes.split(",")}
        plans = {k: v for k, v in plans.items() if k in wanted}
    # The sharing modes themselves, on the engine as it was measured (eager modules): the
    # user programs and compile belong to `mosaic bench`.
    config = BenchConfig(rounds=args.rounds, steps_per_round=args.steps_per_round,
                         warmup_steps=args.warmup, engine=EngineConfig(graphs=not args.no_graphs),
                         lr=args.lr, seed=args.seed, nvml_seconds=0, user_programs=())
    try:
        measurements, _ = measure_plans(model, args.preset, graph, plans, gpu, config)
    except BenchError as exc:
        print(f"FAIL {exc}")
        return 1
    report = _report(args, graph, measurements)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_h200.json").write_text(json.dumps(report, indent=2))
    _print_table(report)
    print(f"wrote {out / 'engine_h200.json'}")
    return 0


def _report(args, graph: MMGraph, measurements: list[PlanMeasurement]) -> dict:
    base = next(m.median_s for m in measurements if m.label == "temporal")
    modes = {m.label: {**m.summary(), "speedup_vs_temporal": base / m.median_s,
                       "pool": m.pool, "plan": m.plan.to_dict()}
             for m in measurements}
    return {"benchmark": "engine_h200", **environment(), "model": graph.name,
            "preset": args.preset, "global_batch": graph.global_batch,
            "graphs": not args.no_graphs, "rounds": args.rounds,
            "steps_per_round": args.steps_per_round, "warmup": args.warmup, "modes": modes}


def _print_table(report: dict) -> None:
    print(f"{report['model']}/{report['preset']} batch {report['global_batch']} on "
          f"{report['hardware']}, graphs={report['graphs']}, torch {report['torch']}")
    print(f"{'mode':14s} {'median ms':>10s} {'p10':>8s} {'p90':>8s} {'speedup':>8s}  quotas")
    for name, m in report["modes"].items():
        quota = "enforced" if m["quotas_enforced"] else m["pool_backend"]
        print(f"{name:14s} {1e3 * m['median_s']:10.2f} {1e3 * m['p10_s']:8.2f} "
              f"{1e3 * m['p90_s']:8.2f} {m['speedup_vs_temporal']:7.2f}x  {quota}")


if __name__ == "__main__":
    sys.exit(main())
