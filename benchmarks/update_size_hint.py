"""The per-weight bf16 update kernel's streaming rate, by the length it was compiled for.

Inductor sizes a pointwise kernel's blocks from the length its first call saw. The engine's
per-weight update is one dynamic-shape kernel for every weight, so without a hint the first
weight updated in the process decides how every later one streams. Each case runs in a fresh
process with its own Inductor cache (a cached kernel would carry another case's tuning):

  first-small      compiled on a MIN_ELEMENTS weight, no hint (the engine before the hint)
  first-large      compiled on a 16M-element weight, no hint
  tuned-large      the engine's kernel (main_weights._update_fn): compiled and autotuned on
                   16M elements of zeros before its first call, on a small weight
  per-size         a kernel per length (the flat layout's)

Usage (GPU): python benchmarks/update_size_hint.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = ("first-small", "first-large", "tuned-large", "per-size")
LENGTHS = (1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26)
BYTES_PER_ELEMENT = 28  # reads main, grad, both moments; writes those three and the weight
REPEATS = 50


def _update_for(case: str):
    import functools

    import torch

    from mosaic.engine import main_weights

    if case == "tuned-large":
        return main_weights._update_fn("cuda", 0.9, 0.999, 1e-8, 0.0, "fp32", True)
    if case == "per-size":
        return main_weights._update_fn("cuda", 0.9, 0.999, 1e-8, 0.0, "fp32", False)
    update = functools.partial(main_weights._adamw_update, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=0.0)
    return torch.compile(update, dynamic=True, fullgraph=True)


def _tensors(n: int):
    import torch

    fp32 = [torch.rand(n, device="cuda") for _ in range(3)]
    grad = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 1e-3
    weight = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    scalars = [torch.tensor(v, device="cuda") for v in (1e-5, 1e-5, 0.5, 0.0, 1.0, 1.0)]
    return [fp32[0], grad, fp32[1], fp32[2], weight, *scalars]


def _ms_per_call(update, args) -> float:
    """GPU time of one call, the calls captured as a CUDA graph as the engine's step is (timed
    eagerly, a call's host cost would hide the kernel's below about 16M elements)."""
    import torch

    for _ in range(3):
        update(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS):
            update(*args)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / REPEATS


def run_case(case: str) -> dict:
    import torch

    from mosaic.engine.main_weights import MIN_ELEMENTS

    update = _update_for(case)
    first = (1 << 24) if case == "first-large" else MIN_ELEMENTS
    update(*_tensors(first))
    rates = {}
    for n in LENGTHS:
        ms = _ms_per_call(update, _tensors(n))
        rates[str(n)] = {"ms": ms, "tb_per_s": BYTES_PER_ELEMENT * n / ms / 1e9}
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return {"case": case, "first_length": first, "dynamo_graphs": graphs, "lengths": rates}


def _keep_kernels(cache: str, case: str, into: str | None) -> None:
    """The case's generated Triton sources, for reading its block sizes and loads."""
    if not into:
        return
    import glob
    import shutil

    os.makedirs(os.path.join(into, case), exist_ok=True)
    for source in glob.glob(os.path.join(cache, "**", "*.py"), recursive=True):
        if "triton_" in Path(source).read_text():
            shutil.copy(source, os.path.join(into, case))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--kernels", help="copy each case's generated kernels under this folder")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case)))
        return
    import torch

    from mosaic.engine.main_weights import marks_size_hints

    results = []
    for case in args.cases.split(","):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            done = subprocess.run([sys.executable, __file__, "--out", "-", "--case", case],
                                  env=env, capture_output=True, text=True, check=False)
            _keep_kernels(cache, case, args.kernels)
        if done.returncode:
            print(f"{case}: failed\n{done.stderr[-2000:]}")
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    hint_api = marks_size_hints()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "mark_dynamic_hint_override": hint_api, "cases": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{report['device']}, torch {report['torch']}, hint_override: {hint_api}")
    print("case              graphs  " + "  ".join(f"{n:>9}" for n in LENGTHS) + "  (TB/s)")
    for r in results:
        row = "  ".join(f"{r['lengths'][str(n)]['tb_per_s']:9.2f}" for n in LENGTHS)
        print(f"{r['case']:<16} {r['dynamo_graphs']:>6}  {row}")


if __name__ == "__main__":
    main()
