"""Simulated scaling study: every zoo model at `paper`, every planner, 8 to 1024 GPUs.

    .venv/bin/python benchmarks/scaling_sim.py [--out benchmarks/results/scaling-sim]
                                               [--gpus 8,16,...] [--models clip,...]

PREDICTED, not measured: iteration times come from the performance model (the shipped H200
profile; across nodes the hierarchical all-reduce over datasheet InfiniBand leads, see
`mosaic.hardware.NODE_PRESETS`), replayed by the event simulator (`mosaic.simulate`), which
must agree with each planner's own prediction. The global batch is weak-scaled: the preset's
batch per 8-GPU node, times the nodes (at 8 GPUs: the preset's batch). Search time is each
planner's wall time on this machine; the mosaic planner runs with its default bound
(`MosaicPlannerConfig.time_limit_s`). Writes one JSON per model: <out>/<model>.json.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("mosaic") is None:  # run as a plain script, without PYTHONPATH=src
    sys.path.insert(0, str(ROOT / "src"))

from mosaic.hardware import make_cluster  # noqa: E402
from mosaic.perf import make_perf_model  # noqa: E402
from mosaic.plan import PlanError  # noqa: E402
from mosaic.planners import get_planner  # noqa: E402
from mosaic.simulate import simulate  # noqa: E402
from mosaic.zoo import MODEL_NAMES, get_model  # noqa: E402

GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)
PLANNERS = ("megatron", "distmm", "spindle", "mosaic")
PRESET = "paper"
HARDWARE = "h200"


def one_size(model: str, gpus: int, perf) -> list[dict]:
    """Every planner's plan for `model` on `gpus` GPUs: predicted, simulated, search time."""
    cluster = perf.cluster
    base = get_model(model).graph(PRESET)
    graph = get_model(model).graph(PRESET, global_batch=base.global_batch * cluster.num_nodes)
    rows = []
    for name in PLANNERS:
        start = time.perf_counter()
        try:
            plan = get_planner(name)(graph, cluster, perf)
        except PlanError as exc:  # a baseline that cannot fit is a row saying so
            rows.append({"gpus": gpus, "planner": name, "error": str(exc)})
            continue
        search_s = time.perf_counter() - start
        sim = simulate(plan, graph, perf)
        used = sum(1 for u in sim.utilisation().values() if u > 0)
        rows.append({
            "gpus": gpus, "nodes": cluster.num_nodes, "global_batch": graph.global_batch,
            "planner": name, "predicted_iteration_s": plan.predicted_iteration_s,
            "simulated_iteration_s": sim.iteration_s,
            "throughput_samples_s": graph.global_batch / plan.predicted_iteration_s,
            "search_time_s": search_s, "gpus_used": used,
            "stages": [s.sharing for s in plan.stages],
            "sharded": plan.sharded_modules(),
            "tensor_parallel": {p.module: p.tensor_parallel for s in plan.stages
                                for p in s.placements if p.tensor_parallel > 1},
            "split_by": plan.meta.get("split_by"),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/scaling-sim")
    parser.add_argument("--gpus", default=",".join(map(str, GPU_COUNTS)))
    parser.add_argument("--models", default=",".join(MODEL_NAMES))
    args = parser.parse_args(argv)
    models, sizes = args.models.split(","), [int(g) for g in args.gpus.split(",")]
    rows: dict[str, list[dict]] = {m: [] for m in models}
    describe, started, cpu0 = {}, time.perf_counter(), time.process_time()
    for gpus in sizes:  # one perf model per cluster size, shared by the models
        perf = make_perf_model("profiled", make_cluster(gpus, HARDWARE), preset=PRESET)
        describe[gpus] = perf.describe()
        for model in models:
            rows[model].extend(one_size(model, gpus, perf))
            print(f"{model} {gpus} GPUs: {time.perf_counter() - started:.1f} s", flush=True)
    cluster = make_cluster(max(sizes), HARDWARE)
    args.out.mkdir(parents=True, exist_ok=True)
    for model in models:
        report = {
            "kind": "simulated (predicted by the performance model, not measured)",
            "model": model, "preset": PRESET, "hardware": HARDWARE,
            "date": datetime.date.today().isoformat(),
            "command": "python benchmarks/scaling_sim.py",
            "batch_rule": "global batch = the preset's per 8-GPU node x nodes (weak scaling)",
            "fabric": {k: getattr(cluster, k) for k in (
                "gpus_per_node", "intra_node_bandwidth_bps", "inter_node_bandwidth_bps",
                "nics_per_node", "inter_node_latency_s", "collective_latency_s")},
            "perf_model": describe[max(sizes)],
            "sweep_wall_s": time.perf_counter() - started,
            "sweep_cpu_s": time.process_time() - cpu0,
            "rows": rows[model],
        }
        (args.out / f"{model}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {len(models)} files to {args.out} in {time.perf_counter() - started:.1f} s "
          f"({time.process_time() - cpu0:.1f} s CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
