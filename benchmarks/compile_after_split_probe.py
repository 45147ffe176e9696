"""Does Inductor compile an LLM after FSDP2 or tensor parallelism has split it, on this torch?

Since 2026-12-05 the engine compiles sharded (FSDP2) and tensor-parallel modules after the
split (compile.CompiledModule.traced_anew) instead of running them eagerly, and gathers a
sharded module's weights in bf16 under autocast (fsdp.gather_dtype). The CPU tests check the
weights on torch 2.13 with Inductor's C++ kernels; this checks the GPU image's torch with
Triton, on one GPU (a one-rank NCCL group: the split changes the module's structure, hooks
and parameter types as on two, with trivial collectives). For the LLM of `--model`, each
case runs `--steps` forward + backward steps under bf16 autocast through the engine's own
compile wrapper and reports: whether it compiled (else why it fell back), the median step
after the first (compile) step, and the LLM's summed gradient against the unsplit eager
module's (relative L2).

    PYTHONPATH=src python benchmarks/compile_after_split_probe.py --out X.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from mosaic.engine import tensor_parallel
from mosaic.engine.compile import CompiledModule, CompileReport
from mosaic.engine.fsdp import gather_dtype, shard_module
from mosaic.engine.session import build_modules, make_batch
from mosaic.zoo import get_model

CASES = (("whole", None), ("whole", "blocks"), ("fsdp", None), ("fsdp", "blocks"),
         ("fsdp", "module"), ("tp", None), ("tp", "blocks"))


def _run(model, preset: str, batch: int, steps: int, split: str, scope: str | None,
         device: torch.device) -> tuple[dict, dict[str, torch.Tensor]]:
    modules = build_modules(model, preset, model.graph(preset).names, seed=0, device=device)
    llm, report = modules["llm"], CompileReport()
    view = CompiledModule("llm", llm, "default", report, scope) if scope else None
    if split == "fsdp":
        shard_module(llm, dist.group.WORLD, device, param_dtype=gather_dtype(True))
    elif split == "tp":
        tensor_parallel.parallelize("llm", llm,
                                    tensor_parallel.mesh_of(dist.group.WORLD, device))
    run = {**modules, "llm": view.traced_anew() if view is not None else llm}
    losses, times = [], []
    for step in range(steps):
        inputs = {k: tuple(t.to(device) for t in v)
                  for k, v in make_batch(model, preset, batch, 0, step).items()}
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model.loss(run, inputs)
        loss.backward()
        _sync(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    grads = {n: tensor_parallel.full_tensor(p.grad).float()
             for n, p in llm.named_parameters() if p.grad is not None}
    return {"split": split, "scope": scope, "losses": losses,
            "first_step_s": times[0], "step_ms": 1e3 * statistics.median(times[1:]),
            "compile": report.to_dict()}, grads


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    diff = sum(float((got[n] - w).pow(2).sum()) for n, w in want.items() if n in got)
    return (diff / sum(float(w.pow(2).sum()) for w in want.values())) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-vl")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()  # the CPU (gloo) only to smoke-test the script
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1, device_id=device if cuda else None)
    model, rows = get_model(args.model), []
    reference = None
    meta = {"torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu", **vars(args)}
    try:
        for split, scope in CASES:
            try:
                row, grads = _run(model, args.preset, args.batch, args.steps, split, scope,
                                  device)
            except Exception as exc:  # a case that fails is a finding, not the end of the probe
                row, grads = {"split": split, "scope": scope,
                              "error": f"{type(exc).__name__}: {exc}"[:500]}, None
            if grads is not None:
                reference = reference or grads
                row["grad_rel_to_eager_whole"] = _relative(grads, reference)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "compile"}), flush=True)
            with open(args.out, "w") as f:  # after every case: a time limit keeps the rest
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    finally:
        dist.destroy_process_group()
    print(f"{'split':6} {'scope':7} {'step ms':>8} {'first s':>8} {'grad rel':>9}  compiled / eager")
    for r in rows:
        how = r.get("error") or (f"{sorted(r['compile']['compiled'])} / {r['compile']['eager']}"
                                 if r["scope"] else "-")
        print(f"{r['split']:6} {r['scope'] or '-':7} {r.get('step_ms', float('nan')):8.2f} "
              f"{r.get('first_step_s', float('nan')):8.1f} "
              f"{r.get('grad_rel_to_eager_whole', float('nan')):9.2e}  {how}")


if __name__ == "__main__":
    main()
