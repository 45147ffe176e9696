"""A/B of the zoo's attention without mask tensors against transformers' SDPA, compiled.

    PYTHONPATH=src python benchmarks/attention_mask_ab.py ofasys:llm:small:8 \
        qwen3-vl:llm:small:8 --out results/attention-mask-ab.json

Under torch.compile (and CUDA-graph capture) transformers builds the all-true causal or
bidirectional mask it skips in eager mode, so SDPA runs with an explicit mask: no flash
kernel, and a causal mask computed in full. The zoo registers an attention implementation that
never builds one (mosaic/zoo/common.py). Here each module is built twice from one seed, once
per implementation, compiled (Inductor, default mode) and trained forward + backward under bf16
autocast, interleaved in rounds; a step is timed with CUDA events. Both must give the same
output (checked before timing). Prints one line per module; --out writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from mosaic.zoo import get_model

VARIANTS = ("sdpa", "mosaic_unpadded_sdpa")


def build(model_name: str, module: str, preset: str, variant: str, device: str
          ) -> torch.nn.Module:
    built = get_model(model_name).build_modules(preset, device, names=[module], seed=0)[module]
    for m in built.modules():
        if hasattr(m, "config") and hasattr(m.config, "_attn_implementation"):
            m.config._attn_implementation = variant
    return built


def step(fn, args) -> torch.Tensor:
    with torch.autocast(args[0].device.type, dtype=torch.bfloat16):
        out = fn(*args)
    out.float().sum().backward()
    return out


def time_steps(fn, args, steps: int) -> list[float]:
    if args[0].device.type != "cuda":  # a CPU run checks the script, it measures nothing
        return [0.0] * steps
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(fn, args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def ab(spec: str, rounds: int, steps: int, device: str = "cuda") -> dict:
    model_name, module, preset, batch = spec.split(":")
    generator = torch.Generator(device).manual_seed(0)
    args = get_model(model_name).module_args(preset, module, int(batch), generator, device)
    compiled, compile_s, outputs = {}, {}, {}
    for variant in VARIANTS:
        module_ = build(model_name, module, preset, variant, device)
        compiled[variant] = torch.compile(module_, dynamic=False)
        start = time.perf_counter()
        outputs[variant] = step(compiled[variant], args).float()
        if device == "cuda":
            torch.cuda.synchronize()
        compile_s[variant] = time.perf_counter() - start
        time_steps(compiled[variant], args, 3)  # warm-up
    difference = (outputs[VARIANTS[0]] - outputs[VARIANTS[1]]).abs().max().item()
    scale = outputs[VARIANTS[0]].abs().max().item()
    times = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for variant in VARIANTS[r % 2:] + VARIANTS[:r % 2]:
            times[variant] += time_steps(compiled[variant], args, steps)
    medians = {v: statistics.median(t) for v, t in times.items()}
    return {"module": spec, "median_ms": medians, "compile_s": compile_s,
            "speedup": medians[VARIANTS[0]] / medians[VARIANTS[1]] if medians[VARIANTS[1]] else 0,
            "max_abs_output_difference": difference, "output_scale": scale,
            "steps_per_variant": len(times[VARIANTS[0]])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="+", help="MODEL:MODULE:PRESET:BATCH")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", default="cuda", help="cpu: check that it runs (no timing)")
    args = parser.parse_args(argv)
    rows = []
    for spec in args.modules:
        row = ab(spec, args.rounds, args.steps, args.device)
        rows.append(row)
        ms = row["median_ms"]
        print(f"{spec}: sdpa {ms['sdpa']:.2f} ms, no mask {ms['mosaic_unpadded_sdpa']:.2f} ms, "
              f"{row['speedup']:.3f}x; output diff {row['max_abs_output_difference']:.3g} "
              f"of {row['output_scale']:.3g}; compile {row['compile_s']}", flush=True)
        if args.out:
            device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
            args.out.write_text(json.dumps({"device": device,
                                            "torch": torch.__version__, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
