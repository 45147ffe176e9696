"""`mosaic train`'s step with steps kept in flight against reading each step before the next.

    PYTHONPATH=src python benchmarks/train_in_flight.py ofasys --preset paper --batch 8 \
        --compile-scope blocks --steps 30 --rounds 2 --out results/x.json [--trace-dir DIR]

One process, one plan (the mosaic planner's, with the shipped profile), trained from the same
seed `rounds` times in each mode, alternating (read each step, in flight, read each step, ...):
CUDA graphs, Inductor, bf16 autocast, fused AdamW, the NaN guard, as `mosaic train` runs.
Each run's median step time leaves out its warm-up steps (compile and capture). MFU against
the 989 TF/s datasheet peak. With --trace-dir, one more in-flight run is traced
(torch.profiler over its last steps) and summarised by kernel class there; with
--bf16-weights too, a run with bf16 weights in DIR/bf16-weights.

On a CPU it runs the tiny preset to check the script; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from mosaic.api import plan as make_plan
from mosaic.engine.measure import environment
from mosaic.engine.rows import row_threads
from mosaic.engine.session import EngineConfig
from mosaic.engine.trainer import TrainConfig, train
from mosaic.hardware import make_cluster
from mosaic.perf import make_perf_model
from mosaic.report.kernel_time import summarise_trace_dir
from mosaic.zoo import get_model

MODES = {"read each step": True, "in flight": False}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--planner", default="mosaic")
    parser.add_argument("--compile-scope", default="module", choices=["module", "blocks"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--trace-dir", type=Path, default=None)
    parser.add_argument("--row-variants", action="store_true",
                        help="also in flight with 1 row thread, and with every step's rows "
                        "made once (what the step costs without drawing data)")
    parser.add_argument("--guard-variants", action="store_true",
                        help="also in flight with the NaN guard held at 'norms' and at 'check' "
                        "(the trainer picks one after five steps; this times both)")
    parser.add_argument("--bf16-weights", action="store_true",
                        help="also in flight with bf16 weights and fp32 main weights "
                        "(`mosaic train --bf16-weights`), alternating with the fp32 runs")
    return parser.parse_args()


def run_config(args: argparse.Namespace, plan, read_each_step: bool, cuda: bool,
               trace_dir: Path | None = None, bf16_weights: bool = False) -> TrainConfig:
    engine = EngineConfig(graphs=cuda, compile="default" if cuda else None,
                          compile_scope=args.compile_scope, bf16_weights=bf16_weights)
    return TrainConfig(model=args.model, preset=args.preset, plan=plan, steps=args.steps,
                       warmup_steps=args.warmup, global_batch=args.batch, engine=engine,
                       progress=False, read_each_step=read_each_step,
                       torch_trace_dir=str(trace_dir) if trace_dir else None)


def host_rows_ms(model_name: str, preset: str, batch: int, steps: int = 3) -> float:
    """Milliseconds one thread takes to draw one step's synthetic rows on this host."""
    model = get_model(model_name)
    start = time.perf_counter()
    for step in range(steps):
        model.make_rows(preset, None, step=step, seed=0, global_batch=batch)
    return 1e3 * (time.perf_counter() - start) / steps


def row_variants(args: argparse.Namespace, plan, cuda: bool) -> dict[str, float]:
    """Median step in flight with the rows drawn on the host by the trainer's threads and by
    one thread (on a GPU the trainer draws the zoo's rows on the device itself), and with rows
    drawn once and reused (the trainer's step without its data's cost): whether drawing
    synthetic rows bounds it."""
    from unittest import mock

    from mosaic.engine import rows

    out = {}
    model = get_model(args.model)
    with mock.patch.object(type(model), "draws_on_device", False):
        if cuda:
            out[f"host, {row_threads()} row threads"] = train(
                run_config(args, plan, False, cuda)).summary
        with mock.patch.object(rows, "row_threads", lambda: 1):
            out["host, 1 row thread"] = train(run_config(args, plan, False, cuda)).summary
    draw = type(model).make_rows
    drawn: dict = {}

    def once(preset, ranges, *, step, seed, global_batch, **where):
        key = tuple(sorted((ranges or {}).items()))
        if key not in drawn:
            drawn[key] = draw(model, preset, ranges, step=0, seed=seed,
                              global_batch=global_batch, **where)
        return drawn[key]

    with mock.patch.object(type(model), "make_rows", lambda self, *a, **k: once(*a, **k)):
        out["rows made once"] = train(run_config(args, plan, False, cuda)).summary
    for label, summary in out.items():
        print(f"{label:>15}: {summary['step_time_median_s'] * 1e3:8.2f} ms", flush=True)
    return {label: summary["step_time_median_s"] for label, summary in out.items()}


def guard_variants(args: argparse.Namespace, plan, cuda: bool) -> dict[str, float]:
    """Median step in flight with the NaN guard held at each kind: what the automatic choice
    (GuardChoice) gains or loses against the other."""
    from unittest import mock

    from mosaic.engine import steps

    out = {}
    for guard, bound in (("norms", float("inf")), ("check", 0.0)):
        with mock.patch.object(steps.GuardChoice, "HOST_BOUND", bound):
            summary = train(run_config(args, plan, False, cuda)).summary
        assert summary["nan_guard"] == guard, summary["nan_guard"]
        out[f"guard {guard}"] = summary["step_time_median_s"]
        print(f"{'guard ' + guard:>15}: {summary['step_time_median_s'] * 1e3:8.2f} ms", flush=True)
    return out


def bf16_weights_runs(args: argparse.Namespace, plan, cuda: bool) -> list[dict]:
    """In flight with bf16 weights, `rounds` times: the trained step without autocast's
    weight casts, against the fp32 runs of the same process."""
    runs = []
    for r in range(args.rounds):
        summary = train(run_config(args, plan, False, cuda, bf16_weights=True)).summary
        runs.append({"round": r, "step_time_median_s": summary["step_time_median_s"],
                     "final_loss": summary["final_loss"]})
        print(f"round {r} {'bf16 weights':>15}: {summary['step_time_median_s'] * 1e3:8.2f} ms "
              f"(loss {summary['final_loss']:.4f})", flush=True)
    return runs


def main() -> None:
    args = arguments()
    cuda = torch.cuda.is_available()
    if not cuda:
        args.preset, args.steps, args.warmup, args.rounds = "tiny", 8, 1, 1
    graph = get_model(args.model).graph(args.preset, global_batch=args.batch)
    cluster = make_cluster(1, "h200")
    plan = make_plan(graph, 1, planner=args.planner,
                     perf_model=make_perf_model("auto", cluster, preset=args.preset))
    runs = []
    for r in range(args.rounds):
        for mode, read_each in MODES.items():
            summary = train(run_config(args, plan, read_each, cuda)).summary
            runs.append({"mode": mode, "round": r,
                         "step_time_median_s": summary["step_time_median_s"],
                         "step_time_p10_s": summary["step_time_p10_s"],
                         "step_time_p90_s": summary["step_time_p90_s"],
                         "final_loss": summary["final_loss"],
                         "nan_guard": summary.get("nan_guard"),
                         "host_launch_share": summary.get("host_launch_share")})
            print(f"round {r} {mode:>15}: {summary['step_time_median_s'] * 1e3:8.2f} ms "
                  f"(p90 {summary['step_time_p90_s'] * 1e3:.2f})", flush=True)
    medians = {mode: statistics.median(x["step_time_median_s"] for x in runs if x["mode"] == mode)
               for mode in MODES}
    peak = cluster.gpu.datasheet_bf16_flops
    result = {"model": args.model, "preset": args.preset, "batch": graph.global_batch,
              "planner": args.planner, "compile_scope": args.compile_scope, "steps": args.steps,
              "warmup_steps": args.warmup, "plan": plan.to_dict(), "runs": runs,
              "median_step_s": medians,
              "mfu": {m: graph.total_flops() / (peak * s) for m, s in medians.items()},
              "speedup_in_flight": medians["read each step"] / medians["in flight"],
              "host_rows_ms_one_thread": host_rows_ms(args.model, args.preset, graph.global_batch),
              "row_threads": row_threads(),
              "rows_on_device": cuda and get_model(args.model).draws_on_device,
              "environment": environment()}
    print(f"{args.model} {args.preset} b{graph.global_batch}: read each step "
          f"{medians['read each step'] * 1e3:.2f} ms, in flight {medians['in flight'] * 1e3:.2f} "
          f"ms: {result['speedup_in_flight']:.3f}x; MFU in flight {result['mfu']['in flight']:.1%}; "
          f"rows {result['host_rows_ms_one_thread']:.1f} ms a step on one thread, "
          f"{result['row_threads']} row threads")
    if args.row_variants:
        result["in_flight_row_variants_s"] = row_variants(args, plan, cuda)
    if args.guard_variants:
        result["in_flight_guard_variants_s"] = guard_variants(args, plan, cuda)
    if args.bf16_weights:
        result["in_flight_bf16_weights_runs"] = bf16_weights_runs(args, plan, cuda)
        result["in_flight_bf16_weights_median_s"] = statistics.median(
            x["step_time_median_s"] for x in result["in_flight_bf16_weights_runs"])
        result["mfu_bf16_weights"] = graph.total_flops() / (
            peak * result["in_flight_bf16_weights_median_s"])
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    if args.trace_dir is not None:
        train(run_config(args, plan, False, cuda, args.trace_dir))
        summarise_trace_dir(args.trace_dir)
        if args.bf16_weights:  # the same run with bf16 weights, traced beside it
            bf16_dir = args.trace_dir / "bf16-weights"
            train(run_config(args, plan, False, cuda, bf16_dir, bf16_weights=True))
            summarise_trace_dir(bf16_dir)


if __name__ == "__main__":
    main()
