"""One process of test_user_program's multi-process tests (gloo, CPU):

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/user_program_driver.py [--shard-states] [--compile MODE] [--reduce-dtype bf16] \
        [--accumulation K] OUT_DIR MODEL [MODEL ...]

For each zoo model (tiny preset, seed-0 batch, as the test's one-process reference), every rank
runs two UserProgram steps (eager unless --compile; DDP, or FSDP2 with --shard-states; the
gradients reduced in fp32 unless --reduce-dtype bf16; K micro-steps each with --accumulation),
gradients zeroed before each (the second step checks that each iteration starts afresh), and
writes OUT_DIR/MODEL/rank{r}.safetensors: the two loss shares ("loss.0", "loss.1"), every
parameter's whole gradient after the second step ("grad.MODULE.PARAM") and the seconds spent
compiling ("compile_seconds").
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from mosaic.engine.tensor_parallel import full_tensor
from mosaic.engine.user_program import UserProgram
from mosaic.graph import MMGraph, ModuleSpec
from mosaic.zoo import get_model


def spec(name: str) -> ModuleSpec:
    return ModuleSpec(name=name, kind="encoder", input_shape=(1,), num_params=1, num_layers=1,
                      hidden_dim=1, tokens_per_sample=1, flops_per_sample=1.0,
                      activation_bytes_per_sample=1.0, output_bytes_per_sample=1.0)


def structure_graph(name: str) -> MMGraph:
    """The zoo model's modules, edges and batch with placeholder costs: the user program reads
    only those, and `ZooModel.graph` would spend seconds per process counting FLOPs."""
    model = get_model(name)
    return MMGraph(name=name, modules=tuple(spec(m) for m in model.module_names),
                   edges=model.edges, global_batch=model.preset("tiny").global_batch)


def run_model(name: str, out_dir: Path, shard_states: bool, compile_mode: str | None,
              reduce_dtype: torch.dtype, accumulation: int, shard_degree: int | None) -> None:
    model = get_model(name)
    graph = structure_graph(name)
    modules = model.build_modules("tiny")
    batch = model.make_inputs("tiny", graph.global_batch, torch.Generator().manual_seed(0))
    saved = {}
    program = UserProgram(graph=graph, modules=modules, compile_mode=compile_mode,
                          device=torch.device("cpu"), shard_states=shard_states,
                          reduce_dtype=reduce_dtype, accumulation=accumulation,
                          shard_degree=shard_degree)
    if shard_states:  # the mesh's dimensions: 2 for hybrid sharding
        mesh = next(p for p in program.parameters() if p.dim() == 2).device_mesh
        saved["mesh_dims"] = torch.tensor([mesh.ndim])
    data = program.local_batch(batch)
    for step in range(2):
        for p in program.parameters():
            p.grad = None
        saved[f"loss.{step}"] = program.step(data).reshape(1)
    for m, module in modules.items():
        for p_name, p in module.named_parameters():
            saved[f"grad.{m}.{p_name}"] = full_tensor(p.grad).contiguous()
    saved["compile_seconds"] = torch.tensor([program.compile_seconds])
    where = out_dir / name
    where.mkdir(parents=True, exist_ok=True)
    save_file(saved, str(where / f"rank{dist.get_rank()}.safetensors"))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shard-states", action="store_true")
    parser.add_argument("--compile", default=None)
    parser.add_argument("--reduce-dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--shard-degree", type=int, default=None)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("models", nargs="+")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        for name in args.models:
            run_model(name, args.out_dir, args.shard_states, args.compile,
                      torch.bfloat16 if args.reduce_dtype == "bf16" else torch.float32,
                      args.accumulation, args.shard_degree)
    finally:
        # FSDP2's state is cyclic garbage that still holds the group: collected at interpreter
        # exit instead, after the group, a gloo rank aborted now and then ("terminate called
        # without an active exception"), as engine/session.end_distributed says of NCCL.
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


if __name__ == "__main__":
    main(sys.argv[1:])
