"""Per module: is the bf16 main-weights update cheaper over the engine's flat gradient
buffer (one launch, after the backward copied each gradient into it) or a weight at a time
(a launch per weight, the gradient read where the backward left it)?

Both updates are captured as CUDA graphs, as in a training step, so the host's launches do
not count; the gradient copy is captured too (one copy a weight, as the backward's). Times
are GPU time by CUDA events, the median of the timed replays (mosaic.profile.main_weights).

    PYTHONPATH=src python benchmarks/main_weights_flat_or_per_weight.py unified-io-2 paper \
        --out OUT.json

Prints a row per module: bf16 weights, their mean size, the per-weight update (one kernel
for every size, as the engine runs it; and one kernel per size), the flat update, the
gradient copy, and which is cheaper (flat costs update + copy).
"""

from __future__ import annotations

import argparse
import json

import torch

from mosaic.engine.main_weights import cast_weights_bf16
from mosaic.profile.main_weights import measure_module as measure_layouts
from mosaic.profile.main_weights import update_s
from mosaic.zoo import get_model


def measure_module(name: str, module: torch.nn.Module) -> dict | None:
    """The profiler's measurement (both layouts and the copy), plus the per-weight update with
    a kernel per size and once more after the others (does the order matter?)."""
    layouts = measure_layouts(module)
    if layouts is None:
        return None
    params = [p for p in module.parameters() if p.dtype == torch.bfloat16 and p.requires_grad]
    fresh = [torch.randn_like(p) * 1e-3 for p in params]
    ms = {k.removesuffix("_s") + "_ms": v * 1e3 for k, v in layouts.items() if k.endswith("_s")}
    per_weight, flat, copy = ms["per_weight_ms"], ms["flat_update_ms"], ms["gradient_copy_ms"]
    n = layouts["bf16_parameters"]
    return {"module": name, "bf16_weights": layouts["bf16_weights"], "bf16_parameters": n,
            "mean_elements": n / layouts["bf16_weights"], "per_weight_ms": per_weight,
            "per_weight_kernel_per_size_ms": update_s(params, fresh, dynamic=False) * 1e3,
            "per_weight_again_ms": update_s(params, fresh) * 1e3,
            "flat_update_ms": flat, "gradient_copy_ms": copy, "flat_total_ms": flat + copy,
            "cheaper": "per-weight" if per_weight < flat + copy else "flat"}


def measure(model_name: str, preset: str, out: str | None, reverse: bool = False) -> dict:
    """Every module's row, each printed and written to `out` as it is measured (a time limit
    keeps the modules done); `reverse`: the modules in reverse graph order (the per-weight
    update measured 1.16-1.36x the flat one on each model's first module, 0.83-2.32x on later
    ones: does the order play a part?)."""
    model = get_model(model_name)
    modules = model.build_modules(preset, torch.device("cuda"), torch.float32,
                                  names=model.graph(preset).names, seed=0)
    cast_weights_bf16(modules.values())
    result = {"model": model_name, "preset": preset, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "order": "reversed" if reverse else "graph",
              "modules": []}
    print(f"{model_name} {preset}: module, bf16 weights, mean elements, per-weight ms "
          "(a kernel per size; again), flat update ms, copy ms, cheaper", flush=True)
    for name, module in (reversed(modules.items()) if reverse else modules.items()):
        if (r := measure_module(name, module)) is None:
            continue
        result["modules"].append(r)
        print(f"  {r['module']:<10} {r['bf16_weights']:>4} {r['mean_elements'] / 1e6:8.2f}M "
              f"{r['per_weight_ms']:7.3f} ({r['per_weight_kernel_per_size_ms']:7.3f}; "
              f"{r['per_weight_again_ms']:7.3f}) {r['flat_update_ms']:7.3f} "
              f"{r['gradient_copy_ms']:7.3f}  {r['cheaper']}", flush=True)
        if out:
            with open(out, "w") as f:
                json.dump(result, f, indent=1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("preset")
    parser.add_argument("--out")
    parser.add_argument("--reverse", action="store_true",
                        help="measure the modules in reverse graph order")
    args = parser.parse_args()
    measure(args.model, args.preset, args.out, args.reverse)


if __name__ == "__main__":
    main()
