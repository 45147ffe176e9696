"""Train a zoo model with a plan: one process per GPU (torchrun), or one process on its own.

    result = train(TrainConfig(model="clip", preset="tiny", planner="megatron", steps=20))

Set-up order, so that a bad input fails before anything is built or written: process group
(when launched by torchrun) -> graph -> plan (made or read on rank 0, sent to all, so every
rank runs the same plan) -> world size and `Plan.validate` -> memory estimate vs free memory
(GPU) -> modules, process groups, stream pool, optimizer -> metrics file -> steps.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from mosaic.engine.comm import PlanComm, broadcast_bytes, check_world_size
from mosaic.engine.runner import PlanRunner, RunnerConfig
from mosaic.engine.timer import Timer
from mosaic.graph import MMGraph
from mosaic.hardware import make_cluster
from mosaic.plan import Plan, PlanError, gpu_memory_bytes

OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


class TrainError(ValueError):
    """A training job that cannot start; the message names the setting and the fix."""


class TrainableModel(Protocol):
    """What the trainer needs from a model (`mosaic.zoo.base.ZooModel` implements it)."""

    name: str

    def build_modules(self, preset: str, device: Any = "cpu", dtype: torch.dtype = torch.float32,
                      *, names: Any = None, seed: int = 0) -> dict[str, nn.Module]: ...

    def make_inputs(self, preset: str, batch_size: int, generator: torch.Generator,
                    device: Any = "cpu") -> dict[str, tuple[torch.Tensor, ...]]: ...

    def graph(self, preset: str, global_batch: int | None = None) -> MMGraph: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    model: str
    """Zoo model name (ignored when `train` is given a model object)."""
    preset: str = "tiny"
    plan_path: str | None = None
    """A plan JSON; exactly one of plan_path, planner, plan."""
    planner: str | None = None
    """A planner name (megatron, distmm, spindle, mosaic), run on rank 0."""
    plan: Plan | None = None
    """A plan object (programmatic use)."""
    num_gpus: int | None = None
    """GPUs to plan for; None: the number of processes."""
    steps: int = 20
    """Optimizer steps in all, warm-up included."""
    warmup_steps: int = 2
    """Leading steps left out of the timing summary (the first is eager when graphs are on)."""
    lr: float = 1e-4
    weight_decay: float = 0.0
    optimizer: str = "adamw"
    """'adamw', or 'sgd' (plain: tests use it, since Adam hides any constant gradient scale)."""
    seed: int = 0
    global_batch: int | None = None
    """Override of the preset's global batch."""
    graphs: bool = False
    """Per-module CUDA graphs (GPU only)."""
    amp: bool | None = None
    """bf16 autocast; None: on for CUDA, off on CPU."""
    device: str | None = None
    """'cpu' forces CPU (gloo) even where CUDA exists; None: CUDA when available."""
    timeline: bool = False
    """Record per-module start/end of the last step on every rank."""
    metrics_path: str | None = None
    """JSONL, one line per step, written by rank 0 once set-up succeeded."""
    hardware: str = "h200"
    perf_model: str = "analytic"
    """Performance model the planner uses."""
    progress: bool = True
    """A rich progress bar on rank 0 (only when stderr is a terminal)."""

    def __post_init__(self) -> None:
        sources = [n for n in ("plan_path", "planner", "plan") if getattr(self, n) is not None]
        if len(sources) != 1:
            raise TrainError(f"give exactly one of plan_path (--plan), planner (--planner) or "
                             f"plan; got {sources or 'none'}")
        if self.steps < 1:
            raise TrainError(f"steps={self.steps} must be >= 1")
        if not 0 <= self.warmup_steps < self.steps:
            raise TrainError(f"warmup_steps={self.warmup_steps} must be in [0, steps={self.steps})")
        if self.graphs and self.warmup_steps < 1:
            raise TrainError("graphs=True runs the first step eagerly to capture: set warmup_steps >= 1")
        if self.optimizer not in OPTIMIZERS:
            raise TrainError(f"optimizer={self.optimizer!r}; use one of {sorted(OPTIMIZERS)}")
        if self.lr <= 0:
            raise TrainError(f"lr={self.lr} must be > 0")
        if self.device not in (None, "cpu", "cuda"):
            raise TrainError(f"device={self.device!r}; use 'cpu', 'cuda' or leave it unset")
        for name in ("num_gpus", "global_batch"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise TrainError(f"{name}={value} must be >= 1 (or unset)")


@dataclass(slots=True)
class TrainResult:
    steps: list[dict[str, Any]]
    """Per-step metrics (the metrics.jsonl lines)."""
    summary: dict[str, Any]
    plan: Plan
    timeline: list[dict[str, Any]] = field(default_factory=list)
    """Last step's module start/end on every rank, when TrainConfig.timeline is on."""
    modules: dict[str, nn.Module] = field(default_factory=dict)
    """This rank's trained modules (in memory only; not part of to_dict)."""

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary, "steps": self.steps, "plan": self.plan.to_dict(),
                "timeline": self.timeline}


# --- seeded model and data: the same on every rank, and in a reference loop ----------------------
def build_modules(model: TrainableModel, preset: str, names: list[str], seed: int,
                  device: torch.device | str = "cpu") -> dict[str, nn.Module]:
    """Modules `names`, weights a function of (seed, name, device type) only (zoo contract)."""
    return model.build_modules(preset, torch.device(device), torch.float32, names=names, seed=seed)


def make_batch(model: TrainableModel, preset: str, global_batch: int, seed: int,
               step: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """The global batch of `step` on the host, identical on every rank."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return model.make_inputs(preset, global_batch, generator, torch.device("cpu"))


# --- set-up --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Dist:
    rank: int
    world_size: int
    device: torch.device
    owns_group: bool


def start_distributed(device: str | None) -> Dist:
    """Join torchrun's world (env://) or run as a one-process world."""
    cuda = torch.cuda.is_available() and device != "cpu"
    if device == "cuda" and not cuda:
        raise TrainError("device='cuda' but no CUDA device is visible; leave device unset")
    running = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if running else int(os.environ.get("WORLD_SIZE", "1"))
    rank = dist.get_rank() if running else int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise TrainError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs "
                             "are visible; use --nproc-per-node <= the GPU count")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    owns = False
    if world > 1 and not running:
        if cuda:
            dist.init_process_group("nccl", init_method="env://", device_id=device)
        else:
            dist.init_process_group("gloo", init_method="env://")
        owns = True
    return Dist(rank=rank, world_size=world, device=device, owns_group=owns)


def _make_plan(config: TrainConfig, graph: MMGraph, world_size: int) -> Plan:
    if config.plan is not None:
        return config.plan
    if config.plan_path is not None:
        return Plan.load(config.plan_path)
    from mosaic.perf import make_perf_model
    from mosaic.planners import get_planner

    cluster = make_cluster(config.num_gpus or world_size, config.hardware)
    return get_planner(config.planner)(graph, cluster, make_perf_model(config.perf_model, cluster))


def _agree_on_plan(config: TrainConfig, graph: MMGraph, d: Dist) -> Plan:
    """Rank 0 makes (or reads) the plan, every rank gets its JSON: a planner need not be
    deterministic. A failure on rank 0 is sent instead, so every rank raises the same error."""
    payload = None
    if d.rank == 0:
        try:
            payload = json.dumps({"plan": _make_plan(config, graph, d.world_size).to_dict()})
        except Exception as exc:  # every rank must hear of it, not hang
            text = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            payload = json.dumps({"error": text})
    message = json.loads(broadcast_bytes(payload.encode() if payload else None, d.device))
    if "error" in message:
        raise TrainError(message["error"])
    return Plan.from_dict(message["plan"])


def _check_memory(plan: Plan, graph: MMGraph, d: Dist) -> None:
    """The plan's per-GPU estimate against each GPU's free memory, checked identically on all
    ranks (free memory is shared first), so all fail together or none does."""
    if d.device.type != "cuda":
        return
    free = torch.zeros(d.world_size, dtype=torch.float64, device=d.device)
    free[d.rank] = torch.cuda.mem_get_info(d.device)[0]
    if d.world_size > 1:
        dist.all_reduce(free)
    for gpu, need in sorted(gpu_memory_bytes(plan, graph).items()):
        if need > free[gpu].item():
            raise TrainError(
                f"GPU {gpu} needs about {need / 2**30:.1f} GiB for this plan (weights, optimizer "
                f"state, activations) but has {free[gpu].item() / 2**30:.1f} GiB free; lower the "
                "batch (--global-batch) or plan over more GPUs")


# --- the loop ------------------------------------------------------------------------------
def train(config: TrainConfig, model: TrainableModel | None = None) -> TrainResult:
    """Train `config.model` (or `model`, any TrainableModel) with the configured plan."""
    t_setup = time.perf_counter()
    d = start_distributed(config.device)
    pool = None
    try:
        if model is None:
            from mosaic.zoo import get_model

            model = get_model(config.model)
        graph = model.graph(config.preset, config.global_batch)
        plan = _agree_on_plan(config, graph, d)
        check_world_size(plan, d.world_size)
        plan.validate(graph, make_cluster(plan.num_gpus, config.hardware))
        _check_memory(plan, graph, d)
        pool, runner, optimizer, comm = _build(config, model, graph, plan, d)
        setup_s = time.perf_counter() - t_setup
        steps, timeline = _loop(config, model, graph, runner, optimizer, comm, d)
        summary = _summary(config, graph, plan, steps, pool, d, setup_s)
        return TrainResult(steps=steps, summary=summary, plan=plan, timeline=timeline,
                           modules=runner.modules)
    except PlanError as exc:
        raise TrainError(str(exc)) from None
    finally:
        if pool is not None:
            pool.close()
        if d.owns_group:
            dist.destroy_process_group()


def _build(config: TrainConfig, model: TrainableModel, graph: MMGraph, plan: Plan, d: Dist):
    from mosaic.engine.green import SMPartitionPool, requests_for_plan

    gpu = make_cluster(plan.num_gpus, config.hardware).gpu
    local = [p.module for s in plan.stages for p in s.placements if d.rank in p.gpus]
    modules = build_modules(model, config.preset, local, config.seed, d.device)
    comm = PlanComm.create(plan, d.device)
    pool = SMPartitionPool.create(requests_for_plan(plan, d.rank, gpu),
                                  d.device.index if d.device.type == "cuda" else None, gpu)
    runner = PlanRunner(plan=plan, graph=graph, modules=modules, comm=comm, pool=pool,
                        config=RunnerConfig(graphs=config.graphs, amp=config.amp,
                                              timeline=config.timeline),
                        device=d.device)
    params = runner.parameters()
    optimizer = (make_optimizer(config.optimizer, params, config.lr, config.weight_decay)
                 if params else None)  # a GPU may hold no module at all
    return pool, runner, optimizer, comm


def make_optimizer(name: str, params: list[nn.Parameter], lr: float,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """AdamW is fused on CUDA: the default multi-tensor AdamW measured about 100 bytes of
    memory traffic per parameter on the H200 (10 ms a step for qwen3-vl small), fused about 28."""
    kwargs = {"lr": lr, "weight_decay": weight_decay}
    if name == "adamw" and params and params[0].is_cuda:
        kwargs["fused"] = True
    return OPTIMIZERS[name](params, **kwargs)


def _loop(config: TrainConfig, model: TrainableModel, graph: MMGraph, runner: PlanRunner,
          optimizer: torch.optim.Optimizer | None, comm: PlanComm, d: Dist):
    timer = Timer(d.device)
    steps: list[dict[str, Any]] = []
    timeline: list[dict[str, Any]] = []
    metrics = _open_metrics(config.metrics_path) if d.rank == 0 else None
    try:
        with _progress(config, d) as (bar, task):
            for step in range(config.steps):
                data = runner.local_batch(make_batch(model, config.preset, graph.global_batch,
                                                     config.seed, step))
                if optimizer is not None:
                    optimizer.zero_grad(set_to_none=True)
                start = timer.mark()
                out = runner.step(data)
                if optimizer is not None:
                    optimizer.step()
                end = timer.mark()
                row = _step_metrics(step, config, graph, comm, d, out.loss,
                                    timer.seconds(start, end))
                steps.append(row)
                if config.timeline and step == config.steps - 1:
                    timeline = _gather_timeline(runner.timeline(out), d)
                if step == 0:
                    runner.capture_graphs()  # no-op unless graphs are on
                if metrics is not None:
                    metrics.write(json.dumps(row) + "\n")
                    metrics.flush()
                bar.update(task, advance=1, loss=row["loss"], ms=1e3 * row["step_time_s"])
    finally:
        if metrics is not None:
            metrics.close()
    return steps, timeline


def _step_metrics(step: int, config: TrainConfig, graph: MMGraph, comm: PlanComm, d: Dist,
                  loss: torch.Tensor, step_time_s: float) -> dict[str, Any]:
    """One metrics line: loss summed over ranks' shares, time and memory of the slowest rank."""
    (total_loss,) = comm.all_reduce_scalars([loss.item()], "sum")
    peak = torch.cuda.max_memory_allocated(d.device) if d.device.type == "cuda" else 0
    slowest_s, peak = comm.all_reduce_scalars([step_time_s, float(peak)], "max")
    row = {"step": step, "loss": total_loss, "step_time_s": slowest_s,
           "samples_per_s": graph.global_batch / slowest_s if slowest_s > 0 else None,
           "warmup": step < config.warmup_steps}
    if d.device.type == "cuda":
        row["peak_memory_bytes"] = int(peak)
    return row


def _gather_timeline(events: list[dict[str, Any]], d: Dist) -> list[dict[str, Any]]:
    if d.world_size > 1:
        gathered: list[Any] = [None] * d.world_size
        dist.all_gather_object(gathered, events)  # in memory only; nothing pickled to disk
        events = [e for part in gathered for e in part]
    return sorted(events, key=lambda e: (e["gpu"], e["start_s"]))


def _open_metrics(path: str | None):
    if path is None:
        return None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return open(path, "w")  # noqa: SIM115 (closed in _loop's finally)


class _NoBar:
    def update(self, *args: Any, **kwargs: Any) -> None:
        pass


def _progress(config: TrainConfig, d: Dist):
    if not (config.progress and d.rank == 0 and sys.stderr.isatty()):
        return contextlib.nullcontext((_NoBar(), None))
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]:.4f}  {task.fields[ms]:.1f} ms/step"),
                        console=Console(stderr=True), transient=False)

    @contextlib.contextmanager
    def bar():
        with progress:
            yield progress, progress.add_task("train", total=config.steps, loss=float("nan"),
                                              ms=float("nan"))

    return bar()


def _summary(config: TrainConfig, graph: MMGraph, plan: Plan, steps: list[dict[str, Any]],
             pool: Any, d: Dist, setup_s: float) -> dict[str, Any]:
    times = np.array([s["step_time_s"] for s in steps if not s["warmup"]])
    median = float(np.median(times))
    return {
        "model": graph.name, "preset": config.preset, "planner": plan.planner,
        "num_gpus": plan.num_gpus, "global_batch": graph.global_batch,
        "steps": config.steps, "warmup_steps": config.warmup_steps, "graphs": config.graphs,
        "step_time_median_s": median,
        "step_time_p10_s": float(np.percentile(times, 10)),
        "step_time_p90_s": float(np.percentile(times, 90)),
        "samples_per_s": graph.global_batch / median if median > 0 else None,
        "first_loss": steps[0]["loss"], "final_loss": steps[-1]["loss"],
        "peak_memory_bytes": max((s.get("peak_memory_bytes", 0) for s in steps), default=0),
        "predicted_iteration_s": plan.predicted_iteration_s,
        "setup_s": setup_s,
        "device": str(d.device), "backend": dist.get_backend() if d.world_size > 1 else None,
        "torch": torch.__version__,
        "pool": pool.describe(),
        "config": {k: v for k, v in asdict(config).items() if k != "plan"},
    }


def train_from_cli(model: str, preset: str = "tiny", plan_path: str | None = None,
                   planner: str | None = None, gpus: int | None = None, steps: int = 20,
                   metrics: str | None = None, graphs: bool = False, *, warmup_steps: int = 2,
                   lr: float = 1e-4, seed: int = 0, global_batch: int | None = None,
                   timeline: bool = False, hardware: str = "h200") -> TrainResult:
    """`mosaic train`: checks that the process count matches --gpus (torchrun or not)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if gpus is not None and gpus != world:
        if "WORLD_SIZE" not in os.environ:
            raise TrainError(f"--gpus {gpus} needs {gpus} processes, one per GPU: launch with "
                             f"`torchrun --standalone --nproc-per-node {gpus} -m mosaic train ...`")
        raise TrainError(f"--gpus {gpus} but torchrun started {world} processes; make them equal")
    config = TrainConfig(model=model, preset=preset, plan_path=plan_path, planner=planner,
                         num_gpus=gpus, steps=steps, warmup_steps=min(warmup_steps, steps - 1),
                         lr=lr, seed=seed, global_batch=global_batch, graphs=graphs,
                         timeline=timeline, metrics_path=metrics, hardware=hardware)
    return train(config)
