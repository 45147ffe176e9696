"""Host time of the trainer's NaN guard per step, by guard, for zoo models (engine/steps.py).

    PYTHONPATH=src python benchmarks/guard_host_cost.py --out results/guard-host-cost/cpu.json

The guard's cost on the host is the launching of its operators, which does not depend on the
device: here every gradient is a tensor on torch's `meta` device (shapes only, no data), so
each operator is dispatched and nothing is computed. 'norms' launches work per gradient
tensor (a norm each, then a stack); 'check' one fused operator per module. Median of REPEAT
calls of `_not_finite` over each module's gradients, summed over modules.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from mosaic.engine.measure import environment
from mosaic.engine.steps import GUARDS, _not_finite
from mosaic.zoo import get_model

MODELS = ("clip:small", "clip:paper", "imagebind:paper", "ofasys:paper", "unified-io-2:paper")


def guard_ms(grads: dict[str, list[torch.Tensor]], guard: str, repeat: int) -> float:
    times = []
    for _ in range(repeat + 2):
        start = time.perf_counter()
        for g in grads.values():
            _not_finite(g, guard)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for spec in args.models:
        name, preset = spec.split(":")
        modules = get_model(name).build_modules(preset, torch.device("meta"), torch.float32)
        grads = {m: [torch.empty_like(p) for p in module.parameters()]
                 for m, module in modules.items()}
        row = {"model": name, "preset": preset,
               "gradient_tensors": sum(len(g) for g in grads.values()),
               "parameters": sum(p.numel() for g in grads.values() for p in g),
               "modules": len(grads),
               "host_ms": {guard: guard_ms(grads, guard, args.repeat) for guard in GUARDS}}
        rows.append(row)
        print(f"{spec:>20}: {row['gradient_tensors']:5d} tensors, "
              + ", ".join(f"{g} {ms:.2f} ms" for g, ms in row["host_ms"].items()), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "repeat": args.repeat,
                                        "environment": environment("cpu (meta tensors)")},
                                       indent=2))


if __name__ == "__main__":
    main()
