"""The optimizer step alone over one zoo model's parameters: torch's fused AdamW over fp32
weights (the engine's default) against MainWeightsAdamW over bf16 GEMM weights with fp32
main weights (`--engine-variant bf16_weights=true`), on one GPU. Gradients sit in fixed
tensors, as the engine's backward graphs leave them, so the main-weights step is captured.

    PYTHONPATH=src python benchmarks/main_weights_step.py ofasys paper --out OUT.json

Prints and writes: tensors and parameters per kind, the host time of the eager steps, the
median GPU time of a step (CUDA events), and the check that every bf16 weight is its main
weight rounded after the steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mosaic.engine.main_weights import MainWeightsAdamW, cast_weights_bf16
from mosaic.engine.session import make_optimizer
from mosaic.zoo import get_model

WARM, TIMED = 4, 10


def _modules(model_name: str, preset: str, bf16: bool):
    model = get_model(model_name)
    modules = model.build_modules(preset, torch.device("cuda"), torch.float32,
                                  names=model.graph(preset).names, seed=0)
    if bf16:
        cast_weights_bf16(modules.values())
    params = [p for m in modules.values() for p in m.parameters() if p.requires_grad]
    for p in params:  # fixed gradient tensors, as the backward graphs leave them
        p.grad = torch.randn_like(p) * 1e-3
    return params


def _time(optimizer, host: list[float]) -> list[float]:
    times = []
    for i in range(WARM + TIMED):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        optimizer.step()
        end.record()
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        if i >= WARM:
            times.append(start.elapsed_time(end))
    return times


def measure(model_name: str, preset: str, kernels: tuple[str, ...]) -> dict:
    row = {"model": model_name, "preset": preset, "device": torch.cuda.get_device_name()}
    params = _modules(model_name, preset, bf16=False)
    host: list[float] = []
    fused = _time(make_optimizer("adamw", params, 1e-5), host)
    row["fused_adamw_fp32"] = {"tensors": len(params), "parameters": sum(p.numel() for p in params),
                               "gpu_ms": statistics.median(fused),
                               "host_ms_median": 1e3 * statistics.median(host)}
    del params
    torch.cuda.empty_cache()
    for kernel in kernels:
        row[f"main_weights_bf16_{kernel}"] = _main_weights(model_name, preset, kernel)
        torch.cuda.empty_cache()
    return row


def _main_weights(model_name: str, preset: str, kernel: str) -> dict:
    params = _modules(model_name, preset, bf16=True)
    optimizer = MainWeightsAdamW(params, 1e-5, dynamic=kernel == "dynamic")
    host: list[float] = []
    start = time.perf_counter()
    main = _time(optimizer, host)
    bf16 = [p for p in params if p.dtype == torch.bfloat16]
    rounded = all(torch.equal(p.detach(), m.to(torch.bfloat16))
                  for p, m in zip(optimizer.bf16, optimizer.mains, strict=True))
    sizes = "every size" if kernel == "dynamic" else "each size"
    return {
        "kernel": f"one Inductor kernel for {sizes}", "distinct_sizes": len({p.numel() for p in bf16}),
        "seconds_with_compile": time.perf_counter() - start,
        "bf16_tensors": len(bf16), "bf16_parameters": sum(p.numel() for p in bf16),
        "fp32_tensors": len(params) - len(bf16),
        "fp32_parameters": sum(p.numel() for p in params if p.dtype != torch.bfloat16),
        "gpu_ms": statistics.median(main), "graphs_captured": len(optimizer.graphs),
        "host_ms_eager_steps": [round(1e3 * h, 2) for h in host[:3]],
        "host_ms_median": 1e3 * statistics.median(host),
        "weights_are_mains_rounded": rounded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("preset")
    parser.add_argument("--kernels", default="dynamic,static",
                        help="the main-weights update compiled for every size (dynamic), per size "
                        "(static), or both")
    parser.add_argument("--out")
    args = parser.parse_args()
    row = measure(args.model, args.preset, tuple(args.kernels.split(",")))
    print(json.dumps(row, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
