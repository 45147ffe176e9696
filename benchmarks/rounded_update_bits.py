"""Where do the rounding bits of the update without main weights come from, and what do they cost?

`mosaic bench --torch-trace` found the update without fp32 main weights (bf16 weights and
moments, engine/rounded_weights.py) streaming 3.1 TB/s where the update with main weights
streams 3.8: 16.5 ms a Unified-IO 2 `paper` b4 step where its 14 bytes a parameter would take
13.4 at 3.8 TB/s. It draws two hashes an element (the moments' 32 bits, then the weight's 16
with another seed). This times one flat update of N parameters (one Inductor kernel each):
  - with main weights, bf16 moments (20 bytes a parameter);
  - without, as engine/rounded_weights.py does it now: the weight's bits remixed from the
    moments' draw by one multiply (14 bytes);
  - without, the weight's bits a second MurmurHash with its own seed (as first shipped);
  - without, the weight rounded to nearest (no bits: the floor, not a training option);
  - without, the first moment in float8 e4m3 with a scale per 256 elements, rounded
    stochastically, the second in bf16 (engine/fp8_first_moment.py, 12 bytes;
    benchmarks/fp8_moments_digits.py found it the one 8-bit kind whose update direction
    stays near fp32 moments' over thousands of steps): does the block's scale, a reduction,
    keep it one kernel at memory speed?
  - a plain copy of 12 bytes a parameter (what the memory system gives);
each as bytes moved over GPU time (CUDA events, the profiler's median: profile/main_weights.py
timed_s).

    PYTHONPATH=src python benchmarks/rounded_update_bits.py --numel 268435456 --out X.json
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
from torch._inductor import config as inductor_config
from torch._inductor import metrics

from mosaic.engine.fp8_first_moment import BLOCK, _first_moment_update_fn
from mosaic.engine.main_weights import _adamw_update, _update_fn, hashed_bits, stochastic_bf16
from mosaic.engine.rounded_weights import _rounded_update_fn
from mosaic.profile.main_weights import timed_s

BETAS, EPS = (0.9, 0.999), 1e-8
WITH_MAIN_BYTES = 20  # reads main 4, grad 2, moments 4; writes main 4, moments 4, weight 2
WITHOUT_MAIN_BYTES = 14  # reads weight 2, grad 2, moments 4; writes weight 2, moments 4
SECOND_SEED_OFFSET = 1 << 20  # the second hash's seed: the step count plus this
FP8_FIRST_MOMENT_BYTES = 12  # reads weight 2, grad 2, m 1, v 2; writes weight 2, m 1, v 2


def gpu_ms(fn) -> float:
    """Median GPU time of `fn` in ms (CUDA events), as the profiler times an update."""
    return timed_s(fn, "cuda") * 1e3


def _without_main(weight_bits):
    """The update without main weights, the weight's 16 bits from `weight_bits(main, step)`
    (None: rounded to nearest)."""
    def update(grad, exp_avg, exp_avg_sq, weight, lr, step_size, bias2_sqrt, found_inf,
               grad_scale, step):
        main = weight.float()
        nearest = torch.empty_like(weight)
        _adamw_update(main, grad, exp_avg, exp_avg_sq, nearest, lr, step_size, bias2_sqrt,
                      found_inf, grad_scale, step, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                      weight_decay=0.0)
        if weight_bits is None:
            weight.copy_(nearest)
        else:
            weight.copy_(stochastic_bf16(main, weight_bits(main, step)))
    return torch.compile(update, dynamic=False)


def _second_hash(main, step):
    return hashed_bits(main, step + SECOND_SEED_OFFSET) & 0xFFFF


def _time_fp8_first_moment(numel: int) -> float:
    """The engine's kernel (engine/fp8_first_moment.py) over one flat weight."""
    s = _scalars()
    update = _first_moment_update_fn("cuda", *BETAS, EPS, 0.0)
    grad = (torch.randn(numel, device="cuda") * 1e-3).bfloat16()
    codes = torch.zeros(numel, device="cuda", dtype=torch.float8_e4m3fn)
    scale = torch.zeros(numel // BLOCK, device="cuda")
    exp_avg_sq = torch.zeros(numel, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(numel, device="cuda").bfloat16()
    return gpu_ms(lambda: update(grad, codes, scale, exp_avg_sq, weight, s["lr"],
                                 s["step_size"], s["bias2_sqrt"], s["found_inf"],
                                 s["grad_scale"], s["step"]))


def _scalars() -> dict[str, torch.Tensor]:
    values = {"lr": 1e-5, "step_size": 1e-4, "bias2_sqrt": 0.03, "found_inf": 0.0,
              "grad_scale": 1.0}
    scalars = {k: torch.tensor(v, device="cuda") for k, v in values.items()}
    return {**scalars, "step": torch.tensor(7, device="cuda")}


def _time_without(numel: int, update) -> float:
    s = _scalars()
    grad = (torch.randn(numel, device="cuda") * 1e-3).bfloat16()
    exp_avg, exp_avg_sq = (torch.zeros(numel, device="cuda", dtype=torch.bfloat16)
                           for _ in range(2))
    weight = torch.randn(numel, device="cuda").bfloat16()
    return gpu_ms(lambda: update(grad, exp_avg, exp_avg_sq, weight, s["lr"], s["step_size"],
                                 s["bias2_sqrt"], s["found_inf"], s["grad_scale"], s["step"]))


def _time_with_main(numel: int) -> float:
    s = _scalars()
    update = _update_fn("cuda", *BETAS, EPS, 0.0, "bf16", False)
    main = torch.randn(numel, device="cuda")
    grad = (torch.randn(numel, device="cuda") * 1e-3).bfloat16()
    exp_avg, exp_avg_sq = (torch.zeros(numel, device="cuda", dtype=torch.bfloat16)
                           for _ in range(2))
    weight = main.bfloat16()
    return gpu_ms(lambda: update(main, grad, exp_avg, exp_avg_sq, weight, s["lr"],
                                 s["step_size"], s["bias2_sqrt"], s["found_inf"],
                                 s["grad_scale"], s["step"]))


def _time_copy(numel: int) -> float:
    """6 bytes a parameter read and 6 written: a plain copy's bandwidth."""
    source, target = (torch.empty(numel * 3, device="cuda", dtype=torch.bfloat16)
                      for _ in range(2))
    return gpu_ms(functools.partial(target.copy_, source))


def _counted(time_it) -> tuple[float, int | None]:
    """(ms, kernels): `time_it()`'s time and how many kernels Inductor generated compiling
    it (its on-disk cache off, so a cached graph is not counted as none). One kernel streams
    each byte once; more re-read the inputs between them."""
    metrics.reset()
    with inductor_config.patch(fx_graph_cache=False):
        ms = time_it()
    return ms, metrics.generated_kernel_count or None  # 0: nothing compiled here


def measure(numel: int) -> dict:
    rows = {"with main weights": (*_counted(lambda: _time_with_main(numel)), WITH_MAIN_BYTES)}
    library = _rounded_update_fn("cuda", *BETAS, EPS, 0.0)
    for name, update in (("without: engine/rounded_weights.py", library),
                         ("without: weight bits a second hash", _without_main(_second_hash)),
                         ("without: rounded to nearest", _without_main(None))):
        rows[name] = (*_counted(lambda u=update: _time_without(numel, u)), WITHOUT_MAIN_BYTES)
        torch.cuda.empty_cache()
    rows["without: fp8 first moment, bf16 second"] = (
        *_counted(lambda: _time_fp8_first_moment(numel)), FP8_FIRST_MOMENT_BYTES)
    torch.cuda.empty_cache()
    rows["copy: 6 bytes a parameter each way"] = (_time_copy(numel), None, 12)
    return {"numel": numel, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "rows": {name: {"gpu_ms": ms, "bytes_per_param": b, "kernels": kernels,
                            "tb_per_s": numel * b / ms / 1e9}
                     for name, (ms, kernels, b) in rows.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 28)
    parser.add_argument("--out")
    args = parser.parse_args()
    result = measure(args.numel)
    for name, row in result["rows"].items():
        print(f"{name:40s} {row['gpu_ms']:7.3f} ms {row['bytes_per_param']:3d} B/param "
              f"{row['tb_per_s']:5.2f} TB/s  kernels {row['kernels'] or '-'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
