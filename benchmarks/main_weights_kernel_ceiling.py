"""How fast can the main-weights AdamW update stream its 28 bytes a weight on this GPU?

`mosaic bench --torch-trace` found the update of Qwen3-VL `small`'s 0.55 B bf16 weights
taking 6.3 ms of a training step (2.4 TB/s) where torch's fused AdamW over the same model's
fp32 weights took 5.0 ms (3.4 TB/s): the saving of bf16 weights (no weight casts) was spent
there. This times, on one GPU, the same number of weights updated
  - per tensor by the Inductor kernel MainWeightsAdamW uses (the model's own tensor sizes),
  - in one launch over flat buffers of the same total size (the per-tensor layout's ceiling),
  - in one launch of a plain Triton kernel written here (4096 elements a program),
  - by torch's fused AdamW over the model's fp32 tensors and over one flat fp32 tensor,
each as bytes moved over GPU time (CUDA events, median of 10 after 3 warm-up calls).

    PYTHONPATH=src python benchmarks/main_weights_kernel_ceiling.py qwen3-vl small --out X.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from mosaic.engine.main_weights import _update_fn, cast_weights_bf16
from mosaic.zoo import get_model

WARM, TIMED = 3, 10
MAIN_WEIGHT_BYTES = 28  # reads main 4, grad 2, moments 8; writes main 4, moments 8, weight 2
FUSED_BYTES = 28  # reads weight 4, grad 4, moments 8; writes weight 4, moments 8


def gpu_ms(fn, warm: int = WARM, timed: int = TIMED) -> float:
    """Median GPU time of `fn` (CUDA events) over `timed` calls after `warm`."""
    times = []
    for i in range(warm + timed):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warm:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def _state(numel: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    device = torch.device("cuda")
    return {"main": torch.randn(numel, device=device), "exp_avg": torch.zeros(numel, device=device),
            "exp_avg_sq": torch.zeros(numel, device=device),
            "grad": torch.randn(numel, device=device).to(dtype) * 1e-3,
            "weight": torch.zeros(numel, device=device, dtype=dtype)}


def _main_weights(sizes: list[int], update) -> float:
    states = [_state(n, torch.bfloat16) for n in sizes]
    scalar = {k: torch.tensor(v, device="cuda") for k, v in
              {"lr": 1e-5, "step_size": 1e-4, "bias2_sqrt": 0.03, "found_inf": 0.0,
               "grad_scale": 1.0, "step": 7}.items()}

    def step() -> None:
        for s in states:
            update(s["main"], s["grad"], s["exp_avg"], s["exp_avg_sq"], s["weight"],
                   scalar["lr"], scalar["step_size"], scalar["bias2_sqrt"], scalar["found_inf"],
                   scalar["grad_scale"], scalar["step"])
    return gpu_ms(step)


def _triton_update():
    """The same arithmetic as main_weights._adamw_update in a hand-written Triton kernel."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(main, grad, exp_avg, exp_avg_sq, weight, lr, step_size, bias2_sqrt, found_inf,
               n, beta1, beta2, eps, weight_decay, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        skip = tl.load(found_inf) > 0
        g = tl.load(grad + offsets, mask=mask).to(tl.float32)
        p = tl.load(main + offsets, mask=mask)
        m = tl.load(exp_avg + offsets, mask=mask)
        v = tl.load(exp_avg_sq + offsets, mask=mask)
        m = m + (g - m) * (1 - beta1)
        v = v * beta2 + g * g * (1 - beta2)
        new = (p * (1 - tl.load(lr) * weight_decay)
               - tl.load(step_size) * m / (tl.sqrt(v) / tl.load(bias2_sqrt) + eps))
        if not skip:
            tl.store(exp_avg + offsets, m, mask=mask)
            tl.store(exp_avg_sq + offsets, v, mask=mask)
            tl.store(main + offsets, new, mask=mask)
            tl.store(weight + offsets, new.to(tl.bfloat16), mask=mask)

    def update(main, grad, exp_avg, exp_avg_sq, weight, lr, step_size, bias2_sqrt, found_inf,
               grad_scale, step):  # gradient clipping's scale and the step: not used here
        n = main.numel()
        kernel[(triton.cdiv(n, 4096),)](main, grad, exp_avg, exp_avg_sq, weight, lr, step_size,
                                        bias2_sqrt, found_inf, n, 0.9, 0.999, 1e-8, 0.0,
                                        BLOCK=4096, num_warps=8)
    return update


def _fused(sizes: list[int]) -> float:
    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
    return gpu_ms(optimizer.step)


def measure(model_name: str, preset: str) -> dict:
    model = get_model(model_name)
    modules = model.build_modules(preset, torch.device("cuda"), torch.float32,
                                  names=model.graph(preset).names, seed=0)
    bf16 = [p.numel() for p in cast_weights_bf16(modules.values())]
    fp32 = [p.numel() for m in modules.values() for p in m.parameters()]
    del modules
    torch.cuda.empty_cache()
    total = sum(bf16)
    rows = {}
    inductor = {dynamic: _update_fn("cuda", 0.9, 0.999, 1e-8, 0.0, "fp32", dynamic) for dynamic in (True, False)}
    for name, sizes, update in (("per tensor, one kernel for every size", bf16, inductor[True]),
                                ("per tensor, one kernel per size", bf16, inductor[False]),
                                ("one launch over flat buffers", [total], inductor[False]),
                                ("Triton written here, per tensor", bf16, _triton_update()),
                                ("Triton written here, flat buffers", [total], _triton_update())):
        ms = _main_weights(sizes, update)
        rows[f"main weights: {name}"] = {"tensors": len(sizes), "parameters": total, "gpu_ms": ms,
                                         "tb_per_s": total * MAIN_WEIGHT_BYTES / ms / 1e9}
        torch.cuda.empty_cache()
    for name, sizes in (("fused AdamW fp32: the model's tensors", fp32),
                        ("fused AdamW fp32: one flat tensor", [sum(fp32)])):
        ms = _fused(sizes)
        rows[name] = {"tensors": len(sizes), "parameters": sum(sizes), "gpu_ms": ms,
                      "tb_per_s": sum(sizes) * FUSED_BYTES / ms / 1e9}
        torch.cuda.empty_cache()
    return {"model": model_name, "preset": preset, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("preset")
    parser.add_argument("--out")
    args = parser.parse_args()
    result = measure(args.model, args.preset)
    for name, row in result["rows"].items():
        print(f"{name:48s} {row['tensors']:5d} tensors {row['parameters'] / 1e9:6.3f} B "
              f"{row['gpu_ms']:7.2f} ms {row['tb_per_s']:5.2f} TB/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
