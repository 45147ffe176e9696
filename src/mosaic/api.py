"""The Python entry points: plan a graph, and plan once for a whole torchrun world.

    import mosaic.api as mosaic
    plan = mosaic.plan(graph, gpus=8, planner="mosaic")   # -> Plan (JSON with plan.save)

`mosaic plan`, `mosaic bench` and `mosaic train` all plan through `plan`, so the same model,
GPUs, preset and performance model give the same plan whichever command asks.

A user's own modules (docs/own-model.md, examples/clip_imu.py):

    graph = mosaic.graph_from_modules("mine", modules, edges, example_inputs, global_batch=64)
    result = mosaic.train(graph, modules, mosaic.plan(graph, gpus=2), data, lr=1e-3, steps=100)
    run = mosaic.bench(graph, modules, data, gpus=1)    # is it faster than your own program?
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mosaic.graph import MMGraph
from mosaic.hardware import make_cluster
from mosaic.plan import Plan

if TYPE_CHECKING:
    from torch import nn

    from mosaic.bench import BenchRun
    from mosaic.engine.checkpoint import CheckpointConfig
    from mosaic.engine.measure import BenchConfig
    from mosaic.engine.session import EngineConfig
    from mosaic.engine.trainer import TrainResult
    from mosaic.perf.base import PerfModel
    from mosaic.user_model import DataSource

__all__ = ["bench", "graph_from_modules", "plan", "plan_on_rank0", "train"]


def plan(graph: MMGraph, gpus: int = 1, hardware: str = "h200", planner: str = "mosaic",
         perf_model: str | PerfModel = "auto", profile_db: str | Path | None = None) -> Plan:
    """A validated, predicted plan of `graph` on `gpus` GPUs of kind `hardware`; `perf_model`:
    a name or a model; `profile_db`: a ProfileDB of your own GPUs (`mosaic profile --db`) for
    the profiled model instead of the one shipped."""
    from mosaic.planners import make_plan

    return make_plan(graph, make_cluster(gpus, hardware), planner, perf_model, profile_db)


def plan_on_rank0(graph: MMGraph, gpus: int, device: Any, *, hardware: str = "h200",
                  planner: str = "mosaic", perf_model: str | PerfModel = "auto",
                  profile_db: str | Path | None = None) -> Plan:
    """`plan` on rank 0, the same plan on every rank of the running world (a planner with a
    time limit need not be deterministic); rank 0's error is raised on every rank."""
    from mosaic.engine.comm import share_from_rank0

    return Plan.from_dict(share_from_rank0(
        lambda: plan(graph, gpus, hardware, planner, perf_model, profile_db).to_dict(), device))


def graph_from_modules(name: str, modules: Mapping[str, nn.Module],
                       edges: Sequence[tuple[str, str]], example_inputs: Mapping[str, Any],
                       global_batch: int, **kwargs: Any) -> MMGraph:
    """The MMGraph of the user's `modules` (costs counted on them as the zoo counts its own);
    see `mosaic.user_model.graph_from_modules` for the calling convention and options."""
    from mosaic.user_model import graph_from_modules as build

    return build(name, modules, edges, example_inputs, global_batch, **kwargs)


def train(graph: MMGraph, modules: Mapping[str, nn.Module], plan: Plan | str,
          data: DataSource, *, optimizer: str = "adamw", lr: float = 1e-4,
          steps: int = 20, warmup_steps: int = 2, weight_decay: float = 0.0, seed: int = 0,
          engine: EngineConfig | None = None, device: str | None = None,
          metrics_path: str | None = None, hardware: str = "h200", progress: bool = True,
          checkpoint: CheckpointConfig | None = None, resume: bool = False,
          clip_grad_norm: float | None = None, lr_warmup_steps: int = 0,
          lr_decay: str = "constant", min_lr: float = 0.0) -> TrainResult:
    """Train the user's `modules` (updated in place) with `plan` (a Plan or a plan JSON path).

    `data` is a callable (step, batch_size) -> {module name: tensor or tuple of tensors}, or an
    iterable (a DataLoader) of such dicts; each gives the GLOBAL batch (graph.global_batch on
    axis 0) and every rank must see the same one: the engine slices each rank's share per
    placement. Or a `mosaic.data.RowSource` such as `mosaic.data.ShardedDataset(dataset)`:
    each rank then loads only the rows it processes (docs/own-model.md, "Data"). Under
    torchrun every rank calls `train` with the same arguments. Returns the trainer's
    TrainResult (per-step metrics, summary, plan, this rank's modules). `clip_grad_norm`,
    `lr_warmup_steps`, `lr_decay` and `min_lr` as `mosaic train`'s options of those names.
    """
    from mosaic.engine.session import EngineConfig
    from mosaic.engine.trainer import TrainConfig
    from mosaic.engine.trainer import train as run
    from mosaic.user_model import UserModel

    model = UserModel(graph, modules, data, seed=seed)
    config = TrainConfig(
        model=graph.name, preset=graph.preset,
        plan=plan if isinstance(plan, Plan) else None,
        plan_path=None if isinstance(plan, Plan) else str(plan),
        steps=steps, warmup_steps=min(warmup_steps, steps - 1), lr=lr,
        weight_decay=weight_decay, optimizer=optimizer, seed=seed,
        engine=engine or EngineConfig(), device=device, metrics_path=metrics_path,
        hardware=hardware, progress=progress, checkpoint=checkpoint, resume=resume,
        clip_grad_norm=clip_grad_norm, lr_warmup_steps=lr_warmup_steps, lr_decay=lr_decay,
        min_lr=min_lr)
    return run(config, model)


def bench(graph: MMGraph, modules: Mapping[str, nn.Module], data: DataSource, *,
          gpus: int = 1, planners: Sequence[str] = ("megatron", "distmm", "spindle", "mosaic"),
          config: BenchConfig | None = None, plans: Mapping[str, Plan] | None = None,
          hardware: str = "h200", perf_model: str = "auto",
          profile_db: str | Path | None = None, seed: int = 0) -> BenchRun:
    """`mosaic bench` on the user's `modules`: each planner's plan (or the given `plans`) and
    the user's own program (eager, and torch.compile(mode="reduce-overhead") per module),
    trained in one process from the same weights on `data`'s first global batch, gradients
    checked equal, then timed in interleaved rounds. The modules are copied, never trained.

    Returns a BenchRun: `.report` is the results JSON of `mosaic bench --json` (per plan:
    median step, spread, MFU, predicted time; `mosaic_speedup_vs_torch_compile`);
    `mosaic.report.bench_report.print_bench_table(run.report)` prints it. Under torchrun
    every rank calls it with the same arguments. `config` (a `mosaic.engine.measure.
    BenchConfig`): rounds, steps, user programs, engine; by default compiled modules and CUDA
    graphs on a GPU, eager on a CPU (where it only checks that everything runs).
    """
    import torch

    from mosaic.bench import run_bench
    from mosaic.engine.measure import BenchConfig
    from mosaic.engine.session import EngineConfig
    from mosaic.user_model import UserModel

    cuda = torch.cuda.is_available()
    config = config or BenchConfig(engine=EngineConfig(graphs=cuda,
                                                       compile="default" if cuda else None))
    model = UserModel(graph, modules, data, seed=seed, fresh_copies=True)
    return run_bench(model, graph, make_cluster(gpus, hardware), config, planners=planners,
                     perf_model=perf_model, profile_db=profile_db, plans=plans)
