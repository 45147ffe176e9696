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

from mosaic.engine.checkpoint import CheckpointConfig, load_checkpoint, save_checkpoint
from mosaic.engine.comm import CommError, PlanComm, check_world_size, share_from_rank0
from mosaic.engine.compile import compile_modules
from mosaic.engine.session import (
    OPTIMIZERS,
    Dist,
    EngineConfig,
    RankSession,
    build_modules,
    local_modules,
    make_batch,
    make_optimizer,
    start_distributed,
)
from mosaic.engine.timer import Timer
from mosaic.errors import MosaicError
from mosaic.graph import MMGraph
from mosaic.hardware import make_cluster
from mosaic.plan import Plan, PlanError, gpu_memory_bytes

__all__ = ["OPTIMIZERS", "TrainConfig", "TrainError", "TrainResult", "build_modules",
           "make_batch", "make_optimizer", "start_distributed", "train", "train_from_cli"]


class TrainError(MosaicError):
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
    """A plan JSON (from `mosaic plan --out`, or hand-written); exactly one of plan_path, plan."""
    plan: Plan | None = None
    """A plan object (`mosaic.plan(...)` makes one). The engine never plans by itself."""
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
    engine: EngineConfig = field(default_factory=EngineConfig)
    """How the engine runs the plan: CUDA graphs, compile, gradient sync, accumulation."""
    device: str | None = None
    """'cpu' forces CPU (gloo) even where CUDA exists; None: CUDA when available."""
    metrics_path: str | None = None
    """JSONL, one line per step, written by rank 0 once set-up succeeded."""
    hardware: str = "h200"
    """GPU kind the plan is validated against (SM count, memory)."""
    progress: bool = True
    """A rich progress bar on rank 0 (only when stderr is a terminal)."""
    checkpoint: CheckpointConfig | None = None
    """Where and how often to checkpoint (torch.distributed.checkpoint, atomic); None: never."""
    resume: bool = False
    """Continue from the latest complete checkpoint in `checkpoint.directory` (any plan)."""

    def __post_init__(self) -> None:
        if self.resume and self.checkpoint is None:
            raise TrainError("resume=True needs a checkpoint directory (--checkpoint-dir)")
        sources = [n for n in ("plan_path", "plan") if getattr(self, n) is not None]
        if len(sources) != 1:
            raise TrainError(f"give exactly one of plan_path (--plan) or plan; got "
                             f"{sources or 'none'} (make a plan with `mosaic plan` or mosaic.plan())")
        if self.steps < 1:
            raise TrainError(f"steps={self.steps} must be >= 1")
        if not 0 <= self.warmup_steps < self.steps:
            raise TrainError(f"warmup_steps={self.warmup_steps} must be in [0, steps={self.steps})")
        if self.engine.graphs and self.warmup_steps < 1:
            raise TrainError("graphs=True runs the first step eagerly to capture: set warmup_steps >= 1")
        if self.optimizer not in OPTIMIZERS:
            raise TrainError(f"optimizer={self.optimizer!r}; use one of {sorted(OPTIMIZERS)}")
        if self.lr <= 0:
            raise TrainError(f"lr={self.lr} must be > 0")
        if self.device not in (None, "cpu", "cuda"):
            raise TrainError(f"device={self.device!r}; use 'cpu', 'cuda' or leave it unset")
        if self.global_batch is not None and self.global_batch < 1:
            raise TrainError(f"global_batch={self.global_batch} must be >= 1 (or unset)")


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


def _agree_on_plan(config: TrainConfig, d: Dist) -> Plan:
    """The plan object, or rank 0's reading of the plan file, on every rank."""
    if config.plan is not None:
        return config.plan
    try:
        shared = share_from_rank0(lambda: Plan.load(config.plan_path).to_dict(), d.device)
    except CommError as exc:  # rank 0's error, heard by every rank
        raise TrainError(str(exc)) from None
    return Plan.from_dict(shared)


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
    """Train `config.model` (or `model`, any TrainableModel) with the given plan."""
    t_setup = time.perf_counter()
    d = start_distributed(config.device)
    session = None
    try:
        if model is None:
            from mosaic.zoo import get_model

            model = get_model(config.model)
        graph = model.graph(config.preset, config.global_batch)
        plan = _agree_on_plan(config, d)
        check_world_size(plan, d.world_size)
        plan.validate(graph, make_cluster(plan.num_gpus, config.hardware))
        _check_memory(plan, graph, d)
        session, optimizer, compiled = _build(config, model, graph, plan, d)
        setup_s = time.perf_counter() - t_setup
        first = _resume(config, session, optimizer)
        steps, timeline = _loop(config, model, graph, session, optimizer, d, first)
        summary = _summary(config, graph, session, steps, d, setup_s)
        summary["compile"] = compiled.to_dict()
        return TrainResult(steps=steps, summary=summary, plan=plan, timeline=timeline,
                           modules=session.modules)
    except PlanError as exc:
        raise TrainError(str(exc)) from None
    finally:
        if session is not None:
            session.close()
        if d.owns_group:
            dist.destroy_process_group()


def _build(config: TrainConfig, model: TrainableModel, graph: MMGraph, plan: Plan, d: Dist):
    gpu = make_cluster(plan.num_gpus, config.hardware).gpu
    modules = build_modules(model, config.preset, local_modules(plan, d.rank), config.seed,
                            d.device)
    views, compiled = compile_modules(modules, config.engine.compile)
    session = RankSession.create(plan, graph, modules, d, gpu, config.engine, views=views)
    params = session.parameters()
    optimizer = (make_optimizer(config.optimizer, params, config.lr, config.weight_decay)
                 if params else None)  # a GPU may hold no module at all
    return session, optimizer, compiled


def _resume(config: TrainConfig, session: RankSession,
            optimizer: torch.optim.Optimizer | None) -> int:
    """The step to start at: 0, or the one after the latest checkpoint. Data depends only on
    (seed, step), so the run continues on exactly the batches it would have seen."""
    if not config.resume:
        return 0
    step, _, _ = load_checkpoint(config.checkpoint.directory, session.modules, optimizer)
    if step >= config.steps:
        raise TrainError(f"the checkpoint is at step {step} but steps={config.steps}; "
                         "raise --steps to train further")
    return step


def _save_if_due(config: TrainConfig, session: RankSession,
                 optimizer: torch.optim.Optimizer | None, steps_done: int) -> None:
    ckpt = config.checkpoint
    if ckpt is not None and (ckpt.due(steps_done) or steps_done == config.steps):
        save_checkpoint(ckpt.directory, steps_done, session.modules, optimizer,
                        plan=session.plan, keep_last=ckpt.keep_last)


def _loop(config: TrainConfig, model: TrainableModel, graph: MMGraph, session: RankSession,
          optimizer: torch.optim.Optimizer | None, d: Dist, first: int = 0):
    timer = Timer(d.device)
    steps: list[dict[str, Any]] = []
    timeline: list[dict[str, Any]] = []
    metrics = _open_metrics(config.metrics_path, append=first > 0) if d.rank == 0 else None
    try:
        with _progress(config, d) as (bar, task):
            bar.update(task, advance=first)
            for step in range(first, config.steps):
                data = session.local_batch(make_batch(model, config.preset, graph.global_batch,
                                                      config.seed, step))
                if optimizer is not None:
                    optimizer.zero_grad(set_to_none=True)
                start = timer.mark()
                out = session.step(data)
                if optimizer is not None:
                    optimizer.step()
                end = timer.mark()
                row = _step_metrics(step, config, graph, session.comm, d, out.loss,
                                    timer.seconds(start, end))
                row["warmup"] = step - first < config.warmup_steps  # a resumed run warms up too
                steps.append(row)
                if config.engine.timeline and step == config.steps - 1:
                    timeline = _gather_timeline(session.runner.timeline(out), d)
                if step == first:
                    session.capture_graphs()  # no-op unless graphs are on
                _save_if_due(config, session, optimizer, step + 1)
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


def _open_metrics(path: str | None, append: bool = False):
    if path is None:
        return None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a" if append else "w")  # noqa: SIM115 (closed in _loop's finally)


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


def _summary(config: TrainConfig, graph: MMGraph, session: RankSession,
             steps: list[dict[str, Any]], d: Dist, setup_s: float) -> dict[str, Any]:
    times = np.array([s["step_time_s"] for s in steps if not s["warmup"]]
                     or [s["step_time_s"] for s in steps])
    median = float(np.median(times))
    plan = session.plan
    return {
        "model": graph.name, "preset": config.preset, "planner": plan.planner,
        "num_gpus": plan.num_gpus, "global_batch": graph.global_batch,
        "steps": config.steps, "warmup_steps": config.warmup_steps,
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
        **session.describe(),
        "config": {k: v for k, v in asdict(config).items() if k != "plan"},
    }


def train_from_cli(model: str, preset: str = "tiny", plan_path: str | None = None,
                   gpus: int | None = None, steps: int = 20, metrics: str | None = None, *,
                   plan: Plan | None = None, engine: EngineConfig | None = None,
                   warmup_steps: int = 2, lr: float = 1e-4, seed: int = 0,
                   global_batch: int | None = None, hardware: str = "h200",
                   checkpoint: CheckpointConfig | None = None, resume: bool = False) -> TrainResult:
    """`mosaic train`: checks that the process count matches --gpus (torchrun or not)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if gpus is not None and gpus != world:
        if "WORLD_SIZE" not in os.environ:
            raise TrainError(f"--gpus {gpus} needs {gpus} processes, one per GPU: launch with "
                             f"`torchrun --standalone --nproc-per-node {gpus} -m mosaic train ...`")
        raise TrainError(f"--gpus {gpus} but torchrun started {world} processes; make them equal")
    config = TrainConfig(model=model, preset=preset, plan_path=plan_path, plan=plan, steps=steps,
                         warmup_steps=min(warmup_steps, steps - 1), lr=lr, seed=seed,
                         global_batch=global_batch, engine=engine or EngineConfig(),
                         metrics_path=metrics, hardware=hardware, checkpoint=checkpoint,
                         resume=resume)
    return train(config)
