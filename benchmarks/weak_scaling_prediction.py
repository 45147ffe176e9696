"""Predicted weak scaling of megatron's plan from 1 to 2 GPUs, per gradient sync and weights.

    .venv/bin/python benchmarks/weak_scaling_prediction.py [--out X.json]
                                                           [--models clip:16,unified-io-2:4]

PREDICTED, not measured: composed iteration times of the shipped H200 profile (surfaces,
transfers, the gradient sums as the engine runs them, the optimizer), without the fitted
per-step engine term, which no two-GPU engine kind has yet (a one-GPU term beside none would
skew the ratio). The per-GPU batch is fixed: a model at B a GPU runs B on one GPU and 2B on
two, compiled by blocks (`--compile-scope blocks`). Weak scaling = 2 x T(1 GPU) / T(2 GPUs);
a user expects about 1.85x or more. Rows: `flat` (each module's buffer summed after its
backward) and `overlapped` (summed bucket by bucket during it), with fp32 weights and with
bf16 weights (whose data-parallel gradients are summed in bf16).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("mosaic") is None:  # run as a plain script, without PYTHONPATH=src
    sys.path.insert(0, str(ROOT / "src"))

from mosaic.cli import load_graph, planned_engine_kind  # noqa: E402
from mosaic.hardware import make_cluster  # noqa: E402
from mosaic.perf import make_perf_model  # noqa: E402
from mosaic.planners import plan_all  # noqa: E402

MODELS = "clip:16,imagebind:16,ofasys:8,unified-io-2:4"
"""model:per-GPU batch, as the 2-GPU `paper` benchmarks run them."""


def composed_ms(model: str, per_gpu_batch: int, gpus: int, grad_sync: str, bf16: bool) -> float:
    cluster = make_cluster(gpus, "h200")
    perf = make_perf_model("profiled", cluster, engine=planned_engine_kind(
        gpus, "blocks", bf16_weights=bf16, grad_sync=grad_sync))
    graph = load_graph(model, "paper", per_gpu_batch * gpus).with_precision(bf16_weights=bf16)
    plan = plan_all(graph, cluster, perf, ["megatron"])[0]
    return 1e3 * perf.composed_time_s(plan, graph)


def rows(models: str) -> list[dict]:
    out = []
    for item in models.split(","):
        model, batch = item.split(":")
        for bf16 in (False, True):
            one = composed_ms(model, int(batch), 1, "flat", bf16)
            for sync in ("flat", "overlapped"):
                two = composed_ms(model, int(batch), 2, sync, bf16)
                out.append({"model": model, "per_gpu_batch": int(batch), "bf16_weights": bf16,
                            "grad_sync": sync, "one_gpu_ms": round(one, 2),
                            "two_gpu_ms": round(two, 2), "weak_scaling": round(2 * one / two, 3)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=MODELS, help="model:per-GPU batch, comma-separated")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    table = rows(args.models)
    for r in table:
        print(f"{r['model']:13s} b{r['per_gpu_batch']:<3d} {'bf16' if r['bf16_weights'] else 'fp32'}"
              f" {r['grad_sync']:10s} 1 GPU {r['one_gpu_ms']:8.2f} ms  2 GPUs {r['two_gpu_ms']:8.2f}"
              f" ms  {r['weak_scaling']:.2f}x")
    if args.out:
        args.out.write_text(json.dumps({"predicted": True, "rows": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
