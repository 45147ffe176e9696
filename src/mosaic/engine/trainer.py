"""Train a zoo model with a plan: one process per GPU (torchrun), or one process on its own.

    result = train(TrainConfig(model="clip", preset="tiny", planner="megatron", steps=20))

Set-up order, so that a bad input fails before anything is built or written: process group
(when launched by torchrun) -> graph -> plan (made or read on rank 0, sent to all, so every
rank runs the same plan) -> world size and `Plan.validate` -> memory estimate vs free memory
(GPU) -> modules, process groups, stream pool, optimizer -> metrics file -> steps.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from mosaic.data import with_dataset
from mosaic.engine import checkpoint as _checkpoint
from mosaic.engine.bf16_optimizer import bf16_optimizer
from mosaic.engine.checkpoint import (
    CheckpointConfig,
    PendingCheckpoint,
    begin_checkpoint,
    latest_checkpoint,
    load_newest_loadable,
)
from mosaic.engine.comm import CommError, check_world_size, share_from_rank0
from mosaic.engine.compile import compile_modules
from mosaic.engine.main_weights import bf16_weights_refusal, cast_weights_bf16
from mosaic.engine.rows import RowPrefetcher, RowsOnDevice
from mosaic.engine.runner import StepOutput
from mosaic.engine.schedule import LRSchedule
from mosaic.engine.session import (
    OPTIMIZERS,
    Dist,
    EngineConfig,
    Fault,
    RankSession,
    batch_loader,
    build_modules,
    draws_on_device,
    end_distributed,
    host_all_reduce,
    local_modules,
    make_batch,
    make_optimizer,
    start_distributed,
)
from mosaic.engine.signals import handling_sigterm, restore_default_sigterm
from mosaic.engine.steps import GradClip, GuardChoice, StepInFlight, finish_step, launch_step
from mosaic.engine.tensor_parallel import local_tensor
from mosaic.engine.timer import Mark, Timer
from mosaic.errors import MosaicError
from mosaic.graph import MMGraph
from mosaic.hardware import gpu_spec, make_cluster
from mosaic.plan import Plan, PlanError, gpu_memory_bytes, memory_fix

__all__ = ["OPTIMIZERS", "TrainConfig", "TrainError", "TrainResult", "build_modules",
           "make_batch", "make_optimizer", "start_distributed", "train", "train_from_cli"]


class TrainError(MosaicError):
    """A training job that cannot start; the message names the setting and the fix."""


class RankError(TrainError):
    """A failure of this rank alone (a lost peer, out of memory): unlike errors every rank
    raises alike, each rank's own message is printed (`per_rank`, read by mosaic.cli.main)."""

    per_rank = True


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
    resume: bool | str = False
    """Continue from the latest complete checkpoint in `checkpoint.directory` (any plan):
    True: there must be one; 'auto': when there is one, else start fresh (a restarted job)."""
    timeout_s: float | None = 600.0
    """Longest wait of any collective: a rank that died or hangs ends the run after this
    long (when this process starts the process group). None: torch's default."""
    skip_nonfinite: bool = False
    """On a NaN/inf loss or gradient, skip that step's update (logged) instead of stopping."""
    lr_warmup_steps: int = 0
    """Steps over which the learning rate ramps linearly up to `lr` (engine/schedule.py)."""
    lr_decay: str = "constant"
    """After warm-up: 'constant', or 'linear' / 'cosine' down to `min_lr` at the last step."""
    min_lr: float = 0.0
    clip_grad_norm: float | None = None
    """Scale the gradients so that their global norm (every module, every rank) is at most
    this, before each update, as torch.nn.utils.clip_grad_norm_ does; the norm before clipping
    is each step's `grad_norm`. The NaN guard then reads the same norms. None: no clipping."""
    read_each_step: bool = False
    """Wait for each step before launching the next, instead of reading it while the next runs
    (engine/steps.py): every error then surfaces at its own step. For debugging, and to
    measure the difference (benchmarks/train_in_flight.py)."""
    data: str = "synthetic"
    """What a zoo model trains on (`mosaic.data.DATASETS`): its synthetic inputs, or 'digits'
    (scikit-learn's handwritten digits, CLIP only; zero-shot accuracy in the summary)."""
    tensorboard_dir: str | None = None
    """Rank 0 also writes loss and step time as TensorBoard scalars here (needs the
    `tensorboard` package)."""
    torch_trace_dir: str | None = None
    """Run the last TRACED_STEPS steps under torch.profiler: every rank writes a Chrome trace
    (trace-rank<R>.json.gz) and its kernels by GPU time (kernels-rank<R>.txt) here."""

    def __post_init__(self) -> None:
        if self.resume not in (False, True, "auto"):
            raise TrainError(f"resume={self.resume!r}; use True (a checkpoint must exist), "
                             "'auto' (resume when one exists) or False")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise TrainError(f"timeout_s={self.timeout_s} must be > 0 seconds (--timeout-s)")
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
        self.lr_schedule()  # its own checks: ScheduleError names the option
        if self.weight_decay < 0:
            raise TrainError(f"weight_decay={self.weight_decay} must be >= 0 (--weight-decay)")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise TrainError(f"clip_grad_norm={self.clip_grad_norm} must be > 0 (--clip-grad-norm)")
        if self.optimizer not in OPTIMIZERS:
            raise TrainError(f"optimizer={self.optimizer!r}; use one of {sorted(OPTIMIZERS)}")
        for bench_only in ("optimizer_overlap", "update_under_forward", "fp8_first_moment"):
            if getattr(self.engine, bench_only):
                raise TrainError(f"engine.{bench_only} is measured by `mosaic bench "
                                 f"--engine-variant {bench_only}=true` only so far; training "
                                 "does not take it yet (leave it False)")
        if self.engine.bf16_weights and self.optimizer != "adamw":
            raise TrainError(f"engine.bf16_weights keeps fp32 main weights in AdamW; "
                             f"optimizer={self.optimizer!r} has none (use adamw)")
        if self.lr <= 0:
            raise TrainError(f"lr={self.lr} must be > 0")
        if self.device not in (None, "cpu", "cuda"):
            raise TrainError(f"device={self.device!r}; use 'cpu', 'cuda' or leave it unset")
        if self.global_batch is not None and self.global_batch < 1:
            raise TrainError(f"global_batch={self.global_batch} must be >= 1 (or unset)")
        from mosaic.data import DATASETS

        if self.data not in DATASETS:
            raise TrainError(f"data={self.data!r}; use one of {', '.join(DATASETS)} (--data)")
        if self.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
            raise TrainError(f"tensorboard_dir={self.tensorboard_dir!r} needs the tensorboard "
                             "package: pip install tensorboard, or drop --tensorboard")

    def lr_schedule(self) -> LRSchedule:
        return LRSchedule(peak=self.lr, total_steps=self.steps, warmup_steps=self.lr_warmup_steps,
                          decay=self.lr_decay, min_lr=self.min_lr)


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


def micro_step_graph(graph: MMGraph, accumulation: int) -> MMGraph:
    """The graph of one micro-step (the session refuses an accumulation that does not divide
    the batch, naming the fix)."""
    if accumulation <= 1 or graph.global_batch % accumulation:
        return graph
    return replace(graph, global_batch=graph.global_batch // accumulation)


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
                f"state, activations) but has {free[gpu].item() / 2**30:.1f} GiB free; "
                f"{memory_fix(plan, graph, gpu, need - free[gpu].item())} (--global-batch)")


# --- the loop ------------------------------------------------------------------------------
def train(config: TrainConfig, model: TrainableModel | None = None) -> TrainResult:
    """Train `config.model` (or `model`, any TrainableModel) with the given plan."""
    t_setup = time.perf_counter()
    d = start_distributed(config.device, config.timeout_s)
    if d.device.type == "cuda":  # the run's peak, not what the process held before it
        torch.cuda.reset_peak_memory_stats(d.device)  # (autotune's candidates, measured first)
    session = None
    try:
        if model is None:
            from mosaic.zoo import get_model

            model = get_model(config.model)
        model = with_dataset(model, config.data, config.preset, config.seed)
        graph = config.engine.holding(model.graph(config.preset, config.global_batch))
        plan = _agree_on_plan(config, d)
        check_world_size(plan, d.world_size)
        # What must fit is one micro-step's batch (the point of accumulating).
        step_graph = micro_step_graph(graph, config.engine.accumulation)
        plan.validate(step_graph, make_cluster(plan.num_gpus, config.hardware))
        _check_memory(plan, step_graph, d)
        session, optimizer, compiled = _build(config, model, graph, plan, d)
        setup_s = time.perf_counter() - t_setup
        first = _resume(config, session, optimizer, d)
        with _tensorboard(config, d, first) as board:
            steps, timeline, guard, stopped = _loop(config, model, graph, session, optimizer,
                                                    d, first, board)
            evaluation = None if stopped else _evaluate(model, graph, session)
            for key, value in (evaluation or {}).items():
                if board is not None and isinstance(value, float):
                    board.add_scalar(f"eval/{key}", value, config.steps)
        summary = _summary(config, graph, session, steps, d, setup_s)
        summary["compile"] = compiled.to_dict()
        # Clipping computes every gradient's norm: the guard reads those, whatever it chose.
        summary["nan_guard"] = "clip norms" if config.clip_grad_norm else guard
        summary["clip_grad_norm"] = config.clip_grad_norm
        if stopped is not None:
            summary["stopped"] = stopped
        if evaluation is not None:
            summary["eval"] = evaluation
        return TrainResult(steps=steps, summary=summary, plan=plan, timeline=timeline,
                           modules=session.modules)
    except PlanError as exc:
        raise TrainError(str(exc)) from None
    finally:
        if session is not None:
            session.close()
        end_distributed(d)


def _build(config: TrainConfig, model: TrainableModel, graph: MMGraph, plan: Plan, d: Dist):
    gpu = make_cluster(plan.num_gpus, config.hardware).gpu
    bf16 = config.engine.bf16_weights
    if bf16 and (refusal := bf16_weights_refusal(
            plan, amp=config.engine.amp, reduce_dtype=config.engine.reduce_dtype,
            grad_sync=config.engine.grad_sync)):
        raise TrainError(refusal)
    modules = build_modules(model, config.preset, local_modules(plan, d.rank), config.seed,
                            d.device)
    if bf16:  # before compiling: the kernels are built for the weights' dtype
        cast_weights_bf16(modules.values())
    views, compiled = compile_modules(modules, config.engine.compile,
                                      scope=config.engine.compile_scope)
    session = RankSession.create(plan, graph, modules, d, gpu, config.engine, views=views)
    params = session.parameters()
    if not params:  # a GPU may hold no module at all
        return session, None, compiled
    optimizer = (bf16_optimizer(params, config.lr, weight_decay=config.weight_decay,
                                moments=config.engine.moments,
                                fp32_main_weights=config.engine.fp32_main_weights,
                                update_group=config.engine.update_group) if bf16
                 else make_optimizer(config.optimizer, params, config.lr, config.weight_decay))
    return session, optimizer, compiled


def _resume(config: TrainConfig, session: RankSession,
            optimizer: torch.optim.Optimizer | None, d: Dist) -> int:
    """The step to start at: 0, or the one after the latest checkpoint. Data depends only on
    (seed, step), so the run continues on exactly the batches it would have seen."""
    if not config.resume:
        return 0
    directory = config.checkpoint.directory
    if config.resume == "auto" and not _has_checkpoint(directory, d):
        return 0
    (step, _, _), passed_over = load_newest_loadable(directory, session.modules, optimizer)
    if d.rank == 0:
        for line in passed_over:
            print(f"mosaic: warning: {line}; passed over for an older one", file=sys.stderr,
                  flush=True)
    if step >= config.steps:
        raise TrainError(f"the checkpoint is at step {step} but steps={config.steps}; "
                         "raise --steps to train further")
    if d.rank == 0:
        print(f"mosaic: resuming at step {step} of {config.steps} from the latest checkpoint "
              f"in {directory}", file=sys.stderr, flush=True)
    return step


def _has_checkpoint(directory: str, d: Dist) -> bool:
    """Rank 0's answer on every rank, so that all ranks resume or none does."""
    found = share_from_rank0(lambda: {"found": latest_checkpoint(directory) is not None},
                             d.device)
    return bool(found["found"])


class _Saves:
    """The run's scheduled checkpoints: written before the next step, or in the background
    (CheckpointConfig.background) with at most one in flight: the next save and the end of
    the run wait for it (collective)."""

    def __init__(self, config: TrainConfig, session: RankSession,
                 optimizer: torch.optim.Optimizer | None, d: Dist, fault: Fault | None) -> None:
        self.config, self.session, self.optimizer, self.d, self.fault = (
            config, session, optimizer, d, fault)
        self.pending: PendingCheckpoint | None = None
        self.saved_at: int | None = None
        """steps_done of the last checkpoint begun."""

    def if_due(self, steps_done: int) -> bool:
        """Save after `steps_done` steps when the schedule says so; whether it did."""
        ckpt = self.config.checkpoint
        if ckpt is None or not (ckpt.due(steps_done) or steps_done == self.config.steps):
            return False
        self._save(steps_done, ckpt.background)
        return True

    def now(self, steps_done: int) -> bool:
        """Save after `steps_done` steps and wait for it (the run is stopping), unless that
        save was begun already; whether there is one (False: no checkpoint directory)."""
        if self.config.checkpoint is None:
            return False
        if self.saved_at != steps_done:
            self._save(steps_done, background=False)
        self.wait()
        return True

    def _save(self, steps_done: int, background: bool) -> None:
        ckpt = self.config.checkpoint
        self.wait()
        with _fault_in_checkpoint(self.fault, self.d.rank, steps_done):
            self.pending = begin_checkpoint(ckpt.directory, steps_done, self.session.modules,
                                            self.optimizer, plan=self.session.plan,
                                            keep_last=ckpt.keep_last, background=background,
                                            timeout_s=self.config.timeout_s)
        self.saved_at = steps_done
        if not background:
            self.wait()

    def wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()


@contextlib.contextmanager
def _fault_in_checkpoint(fault: Fault | None, rank: int, steps_done: int):
    """Test-only (MOSAIC_FAULT ...:during=checkpoint): fire the fault once this rank's shard
    is written, before rank 0 publishes the checkpoint, by wrapping the checkpoint module's
    DCP write for the duration of this save. Unset, nothing is wrapped."""
    if fault is None or not fault.due(rank, steps_done, "checkpoint"):
        yield
        return
    write = _checkpoint._dcp_save

    def write_then_fire(*args: Any, **kwargs: Any) -> None:
        write(*args, **kwargs)
        fault.fire()

    _checkpoint._dcp_save = write_then_fire
    try:
        yield
    finally:
        _checkpoint._dcp_save = write


def _evaluate(model: TrainableModel, graph: MMGraph, session: RankSession) -> dict | None:
    """The data source's score of the trained modules (the digits' zero-shot accuracy), on a
    rank that holds every module; None elsewhere, or when the source has no score."""
    evaluate = getattr(model, "evaluate", None)
    if evaluate is None or not set(graph.names) <= set(session.modules):
        return None
    # Under the training's autocast: bf16 weights (--bf16-weights) meet fp32 inputs otherwise.
    with (torch.autocast(session.runner.device.type, dtype=torch.bfloat16)
          if session.runner.amp else contextlib.nullcontext()):
        return evaluate(session.modules)


@contextlib.contextmanager
def _tensorboard(config: TrainConfig, d: Dist, first: int):
    """Rank 0's TensorBoard writer (None when off); a resumed run drops the events of the
    steps it runs again (purge_step), as the metrics file drops their lines."""
    if d.rank != 0 or config.tensorboard_dir is None:
        yield None
        return
    from torch.utils.tensorboard import SummaryWriter  # needs `tensorboard` (checked early)

    writer = SummaryWriter(config.tensorboard_dir, purge_step=first or None)
    try:
        yield writer
    finally:
        writer.close()


TRACED_STEPS = 3


@contextlib.contextmanager
def _torch_trace(config: TrainConfig, d: Dist, first: int):
    """torch.profiler over the run's last TRACED_STEPS steps (after graph capture), written
    per rank when it ends; an object whose step() is a no-op when tracing is off."""
    if config.torch_trace_dir is None:
        yield SimpleNamespace(step=lambda: None)
        return
    from torch.profiler import ProfilerActivity, profile, schedule

    left = config.steps - first
    active = min(TRACED_STEPS, max(1, left - 2))  # the first steps compile and capture
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if d.device.type == "cuda" else [])
    out = Path(config.torch_trace_dir)
    out.mkdir(parents=True, exist_ok=True)

    def write(prof: Any) -> None:
        prof.export_chrome_trace(str(out / f"trace-rank{d.rank}.json.gz"))
        sort = "self_device_time_total" if d.device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=40)
        (out / f"kernels-rank{d.rank}.txt").write_text(
            f"{config.model} {config.preset}: last {active} steps, rank {d.rank}\n{table}\n")

    wait = max(0, left - active - 1)
    with profile(activities=activities, on_trace_ready=write,
                 schedule=schedule(wait=wait, warmup=1, active=active)) as prof:
        yield _WindowedTracer(prof, first_active=wait + 1, device=d.device)


class _WindowedTracer:
    """torch.profiler's step(), and a device sync just before the first traced step: steps
    run in flight, so without it the kernels of the step before (still queued) land in the
    trace too, and the per-step kernel times of a trace of 3 steps came out 10-20% high."""

    def __init__(self, prof: Any, first_active: int, device: torch.device) -> None:
        self.prof, self.first_active, self.device, self.done = prof, first_active, device, 0

    def step(self) -> None:
        self.done += 1
        if self.done == self.first_active and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.prof.step()


def _board_scalars(board: Any, row: dict[str, Any]) -> None:
    if board is None:
        return
    board.add_scalar("train/loss", row["loss"], row["step"])
    board.add_scalar("train/step_time_ms", 1e3 * row["step_time_s"], row["step"])
    if row.get("samples_per_s") is not None:
        board.add_scalar("train/samples_per_s", row["samples_per_s"], row["step"])
    for key in ("grad_norm", "lr", "mfu"):
        if row.get(key) is not None:
            board.add_scalar(f"train/{key}", row[key], row["step"])


def _loop(config: TrainConfig, model: TrainableModel, graph: MMGraph, session: RankSession,
          optimizer: torch.optim.Optimizer | None, d: Dist, first: int = 0, board: Any = None):
    fault = Fault.from_env()  # test-only fault injection; None in a real run
    steps: list[dict[str, Any]] = []
    timeline: list[dict[str, Any]] = []
    metrics = _open_metrics(config, d, first)
    stopped: dict[str, Any] | None = None
    try:
        with _progress(config, d) as (bar, task), _torch_trace(config, d, first) as tracer, \
                _row_prefetcher(model, config, graph, session, first) as rows, \
                _sigterm_requests_stop() as stop:
            bar.update(task, advance=first)

            def record(row: dict[str, Any]) -> None:
                row["warmup"] = row["step"] - first < config.warmup_steps  # a resumed run too
                steps.append(row)
                if metrics is not None:
                    metrics.write(json.dumps(row) + "\n")
                    metrics.flush()
                _board_scalars(board, row)
                bar.update(task, advance=1, loss=row["loss"], ms=1e3 * row["step_time_s"])
                stop.step_read(row["step_time_s"])

            pipeline = _StepPipeline(config, graph, session, optimizer, d, fault, record, stop)
            saves = _Saves(config, session, optimizer, d, fault)
            for step in range(first, config.steps):
                if fault is not None and fault.due(d.rank, step):
                    fault.fire()
                _mark_progress(d, step)
                # Only the last step's timeline is kept: marking every module's start and end
                # every step is host work (events) for nothing.
                session.runner.record_timeline = (config.engine.timeline
                                                  and step == config.steps - 1)
                with _named_failures(config, session, d, step):
                    pipeline.launch(step, rows.get(step))
                    output = _between_steps(config, session, pipeline, rows, saves, step,
                                            first)
                    if config.engine.timeline and step == config.steps - 1:
                        timeline = _gather_timeline(session.runner.timeline(output), d)
                    if pipeline.stop_seen and step + 1 < config.steps:
                        stop.agreed()
                        stopped = _stop_after(step, pipeline, saves, config, d)
                tracer.step()
                if stopped is not None:
                    break
            saves.wait()  # the last save, if written in the background
    finally:
        if metrics is not None:
            metrics.close()
    return steps, timeline, pipeline.guard.guard, stopped


def _stop_after(step: int, pipeline: _StepPipeline, saves: _Saves, config: TrainConfig,
                d: Dist) -> dict[str, Any]:
    """Every rank read the same stop request with the same step: finish `step`, save a
    checkpoint after it (where the run has a checkpoint directory) and say so."""
    pipeline.drain()
    saved = saves.now(step + 1)
    where = (f"checkpoint step {step + 1} saved in {config.checkpoint.directory}; continue "
             "with --resume auto" if saved else "no --checkpoint-dir, so nothing was saved")
    if d.rank == 0:
        print(f"mosaic: SIGTERM: stopped after step {step} of {config.steps}; {where}",
              file=sys.stderr, flush=True)
    return {"signal": "SIGTERM", "steps_done": step + 1,
            "checkpoint_step": step + 1 if saved else None}


STOP_GRACE_MIN_S = 60.0
STOP_GRACE_STEPS = 4
"""After SIGTERM a run that has not agreed on its stop within max(STOP_GRACE_MIN_S,
STOP_GRACE_STEPS x its slowest step so far) is stuck, and exits as the default handler
would. On the H200 a GPU test outlived `timeout`'s SIGTERM by 400 s, most likely so:
`timeout` signals the whole process group, which ends Inductor's compile workers too, and
torch 2.11 then waits for them forever (PyTorch PR 189290), while the trainer, taking the
signal as a request to stop after a step, never gets there. Most schedulers kill 30 s after
their notice anyway; nothing is lost that a kill would keep."""


class _StopRequest:
    """Whether this process was sent SIGTERM (a scheduler's preemption notice, torchrun
    shutting the run down). The trainer does not stop at once: each rank adds its request to
    the step's health, summed over ranks with it, so all ranks learn of it with the same step
    and stop after that one, checkpointed. Unless that does not happen in time
    (STOP_GRACE_MIN_S): the process then exits with the default handler's status. The
    deadline's thread starts with the loop, not in the signal handler (which may interrupt
    the main thread inside threading's own locks)."""

    def __init__(self) -> None:
        self.requested = False
        self.slowest_step_s = 0.0
        self._asked, self._agreed = threading.Event(), threading.Event()
        threading.Thread(target=self._exit_unless_agreed, daemon=True,
                         name="mosaic-stop-deadline").start()

    def ask(self) -> None:
        self.requested = True
        self._asked.set()

    def step_read(self, seconds: float) -> None:
        self.slowest_step_s = max(self.slowest_step_s, seconds)

    def agreed(self) -> None:
        """The ranks agreed on the step to stop after (or the loop ended): no deadline."""
        self._agreed.set()
        self._asked.set()  # ends the thread

    def _exit_unless_agreed(self) -> None:
        self._asked.wait()
        grace_s = max(STOP_GRACE_MIN_S, STOP_GRACE_STEPS * self.slowest_step_s)
        if self._agreed.wait(grace_s):
            return
        print(f"mosaic: SIGTERM: the run did not reach a step to stop after within "
              f"{grace_s:.0f} s (a compile whose workers the signal ended never returns); "
              "exiting without a new checkpoint: resume from the last one",
              file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGTERM)


@contextlib.contextmanager
def _sigterm_requests_stop():
    """A _StopRequest that SIGTERM sets while the loop runs (main thread only). A second
    SIGTERM ends the process as the default handler does."""
    request = _StopRequest()

    def ask() -> None:
        restore_default_sigterm()
        request.ask()

    try:
        with handling_sigterm(ask):
            yield request
    finally:
        request.agreed()


def _row_prefetcher(model: TrainableModel, config: TrainConfig, graph: MMGraph,
                    session: RankSession, first: int) -> RowPrefetcher | RowsOnDevice:
    """The rows of each step: drawn on the GPU where the model's synthetic rows can be
    (engine/rows.py), else made on the host by threads, ahead, pinned on CUDA."""
    device = session.runner.device
    on_device = device.type == "cuda" and draws_on_device(model)

    def make(step: int) -> list[dict[str, Any]]:
        return session.local_rows(batch_loader(model, config.preset, graph.global_batch,
                                               config.seed, step,
                                               device if on_device else None))

    if on_device:
        return RowsOnDevice(make)
    return RowPrefetcher(make, range(first, config.steps), pin=device.type == "cuda")


def _between_steps(config: TrainConfig, session: RankSession, pipeline: _StepPipeline,
                   rows: RowPrefetcher | RowsOnDevice, saves: _Saves, step: int,
                   first: int) -> StepOutput | None:
    """What runs after launching `step`: reading it where it must be done (before the graph
    capture after the first step, a checkpoint, the end; or always, `read_each_step`), the
    capture and the checkpoint. The step's output when it was read."""
    last = step == config.steps - 1
    due = config.checkpoint is not None and config.checkpoint.due(step + 1)
    output = pipeline.drain() if step == first or last or due or config.read_each_step else None
    if step == first:
        rows.settle()  # pinning allocates host memory: not during a capture
        session.capture_graphs()  # no-op unless graphs are on
        pipeline.pause()
    if saves.if_due(step + 1):
        pipeline.pause()
    return output


class _StepPipeline:
    """Launches each step behind the one before and reads that one afterwards
    (engine/steps.py says why), turning each into its metrics line. A step's time runs from
    the previous step's end on the GPU, so time the GPU waited for the host between steps
    counts, unless something else ran there (`pause`: graph capture, a checkpoint save)."""

    def __init__(self, config: TrainConfig, graph: MMGraph, session: RankSession,
                 optimizer: torch.optim.Optimizer | None, d: Dist, fault: Fault | None,
                 record: Callable[[dict[str, Any]], None], stop: _StopRequest) -> None:
        self.config, self.graph, self.session, self.optimizer = config, graph, session, optimizer
        self.d, self.fault, self.record, self.stop = d, fault, record, stop
        self.stop_seen = False
        """A step read so far carried some rank's stop request."""
        self.timer = Timer(d.device)
        self.pending: tuple[StepInFlight, Mark | None] | None = None
        self.last_end: Mark | None = None
        self.guard = GuardChoice()
        self.launch_s: dict[int, float] = {}
        self.clip = gradient_clip(config, session)
        self.schedule = config.lr_schedule()

    def launch(self, step: int, rows: list[dict[str, Any]]) -> None:
        poison = (_poison_gradient if self.fault is not None and self.fault.action == "nan"
                  and self.fault.due(self.d.rank, step) else None)
        started = time.perf_counter()
        if not self.schedule.constant and self.optimizer is not None:
            rate = self.schedule.at(step)
            for group in self.optimizer.param_groups:
                group["lr"] = rate
        flight, checked = launch_step(self.session, self.optimizer, rows, self.timer, step,
                                      poison, self.guard.guard, self.stop.requested, self.clip)
        self.launch_s[step] = time.perf_counter() - started
        before, self.pending = self.pending, (flight, self.last_end)
        self.last_end = flight.end
        if before is not None:
            self._finish(*before)
        if checked and not self.config.skip_nonfinite:  # checked on the host: stop now
            self._judge(step, checked)

    def drain(self) -> StepOutput | None:
        """Read the step in flight (waits for it); its output."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        self._finish(*pending)
        return pending[0].output

    def pause(self) -> None:
        """Work other than steps ran since the last step: the next step's time starts at its
        own launch."""
        self.last_end = None

    def _finish(self, flight: StepInFlight, since: Mark | None) -> None:
        done = finish_step(flight, self.timer, since)
        self.stop_seen = self.stop_seen or done.stop_requested
        launch_s = self.launch_s.pop(done.step)
        # Clipping's norms are the guard: no other guard to choose.
        switched = self.clip is None and self.guard.observe(launch_s, done.seconds)
        if switched and self.d.rank == 0 and self.d.device.type == "cuda":
            print(f"mosaic: launching a step takes {launch_s * 1e3:.1f} of its "
                  f"{done.seconds * 1e3:.1f} ms: the NaN guard checks each module's gradients "
                  "in one kernel from here on", file=sys.stderr, flush=True)
        row = _step_metrics(done.step, self.config, self.graph, self.d, done.loss, done.seconds)
        # This rank's host time to launch the step: near step_time_s, the host bounds it.
        row["launch_s"] = launch_s
        if not self.schedule.constant:
            row["lr"] = self.schedule.at(done.step)
        if done.grad_norm is not None:
            row["grad_norm"] = done.grad_norm  # before clipping, as torch's clip_grad_norm_ returns
        if done.bad:
            self._judge(done.step, done.bad)
            row["skipped"] = ", ".join(done.bad)
        self.record(row)

    def _judge(self, step: int, bad: list[str]) -> None:
        if not self.config.skip_nonfinite:
            raise TrainError(f"step {step}: non-finite {', '.join(bad)}; lower --lr or check "
                             "the inputs, or pass --skip-nonfinite to skip such steps' updates")
        if self.d.rank == 0:
            print(f"mosaic: warning: step {step}: non-finite {', '.join(bad)}; its update was "
                  "skipped (--skip-nonfinite)", file=sys.stderr, flush=True)


def gradient_clip(config: TrainConfig, session: RankSession) -> GradClip | None:
    """What clip_grad_norm asks of this rank: the bound, and how many ranks hold a copy of
    each of its gradient tensors (replicas, shards)."""
    if config.clip_grad_norm is None:
        return None
    return GradClip(max_norm=config.clip_grad_norm, copies=session.runner.gradient_copies)


def _poison_gradient(session: RankSession) -> None:
    """Test-only (MOSAIC_FAULT nan:...): NaN in this rank's first module's first gradient."""
    for _, module in sorted(session.modules.items()):
        for p in module.parameters():
            if p.grad is not None:
                local_tensor(p.grad).view(-1)[0] = float("nan")
                return


def _step_metrics(step: int, config: TrainConfig, graph: MMGraph, d: Dist,
                  total_loss: float, step_time_s: float) -> dict[str, Any]:
    """One metrics line: the loss summed over ranks' shares (already reduced), time and memory
    of the slowest rank."""
    peak = _peak_allocated(d.device) if d.device.type == "cuda" else 0
    slowest_s, peak = host_all_reduce([step_time_s, float(peak)], "max", d.host_group)
    row = {"step": step, "loss": total_loss, "step_time_s": slowest_s,
           "samples_per_s": graph.global_batch / slowest_s if slowest_s > 0 else None,
           "warmup": step < config.warmup_steps}
    if d.device.type == "cuda":
        row["peak_memory_bytes"] = int(peak)
        row["mfu"] = model_flops_utilisation(graph, d.world_size, config.hardware, slowest_s)
    return row


def model_flops_utilisation(graph: MMGraph, gpus: int, hardware: str,
                            step_s: float) -> float | None:
    """The model's FLOPs a step (forward and backward of every module, MMGraph.total_flops)
    over what `gpus` GPUs of kind `hardware` do in `step_s` at their datasheet dense bf16 peak
    (989 TF/s on an H200): the MFU of `mosaic bench` and of the papers. Of a trained step,
    with steps in flight, it is what a training run gets; the bench times each step alone."""
    if step_s <= 0:
        return None
    return graph.total_flops() / (gpus * gpu_spec(hardware).datasheet_bf16_flops * step_s)


def _peak_allocated(device: torch.device) -> int:
    """torch.cuda.max_memory_allocated without flattening every allocator statistic into a
    dict first (two thirds of its host time: it runs every step)."""
    return torch.cuda.memory_stats_as_nested_dict(device)["allocated_bytes"]["all"]["peak"]


# --- failures: name the rank, the step and the fix -------------------------------------------
def _mark_progress(d: Dist, step: int) -> None:
    """Each rank notes the step it starts in the process group's key-value store (one small
    write per step), so that a rank whose collective times out can name the ranks behind."""
    store = _store(d)
    if store is not None:
        with contextlib.suppress(Exception):  # diagnostics only: never fail a step over it
            store.set(f"mosaic/progress/{d.rank}", str(step))


def _store(d: Dist):
    if d.world_size == 1 or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()  # private; absent: no diagnosis
    except Exception:
        return None


def _ranks_behind(d: Dist, step: int) -> list[str]:
    store, behind = _store(d), []
    if store is None:
        return behind
    for rank in range(d.world_size):
        key = f"mosaic/progress/{rank}"
        try:
            last = int(store.get(key)) if store.check([key]) else -1
        except Exception:
            return []
        if last < step:
            behind.append(f"rank {rank} (last started step {last})")
    return behind


def _is_comm_failure(exc: BaseException) -> bool:
    """A collective that timed out or lost its peer (gloo, NCCL), not a bug of ours."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        word in text for word in ("timed out", "timeout", "connection", "closed by peer",
                                  "nccl", "gloo"))


@contextlib.contextmanager
def _named_failures(config: TrainConfig, session: RankSession, d: Dist, step: int):
    """Turn a lost rank and a CUDA out-of-memory error into one line naming the rank, the
    step and the fix; anything else keeps its traceback."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        if d.device.type != "cuda":
            raise
        raise RankError(_oom_message(session, d, step)) from exc
    except Exception as exc:
        if d.world_size == 1 or isinstance(exc, MosaicError) or not _is_comm_failure(exc):
            raise
        behind = _ranks_behind(d, step)
        who = (f"{', '.join(behind)} did not reach it: it died or hangs" if behind
               else "another rank died or hangs")
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise RankError(
            f"rank {d.rank}: a collective of step {step} failed ({first_line}); {who}. "
            f"Collectives wait at most --timeout-s {config.timeout_s}; see that rank's own "
            "error, and restart with --resume auto to continue from the last checkpoint"
        ) from exc


def _oom_message(session: RankSession, d: Dist, step: int) -> str:
    estimate = gpu_memory_bytes(session.plan, session.graph).get(d.rank, 0)
    peak = torch.cuda.max_memory_allocated(d.device)
    total = torch.cuda.get_device_properties(d.device).total_memory
    return (f"rank {d.rank} ({d.device}) ran out of GPU memory at step {step}: the plan "
            f"estimates {estimate / 2**30:.2f} GiB for GPU {d.rank}, torch's peak allocation "
            f"was {peak / 2**30:.2f} GiB of {total / 2**30:.2f} GiB; lower --batch, raise "
            "--accumulation, or plan over more GPUs")


def _gather_timeline(events: list[dict[str, Any]], d: Dist) -> list[dict[str, Any]]:
    if d.world_size > 1:
        gathered: list[Any] = [None] * d.world_size
        dist.all_gather_object(gathered, events)  # in memory only; nothing pickled to disk
        events = [e for part in gathered for e in part]
    return sorted(events, key=lambda e: (e["gpu"], e["start_s"]))


def _open_metrics(config: TrainConfig, d: Dist, first: int):
    """Rank 0's metrics file. On resume, the lines of steps >= `first` (run after the
    checkpoint, before the crash) are dropped first, so that the file ends up with every step
    once, as the weights saw them; a line cut short by the crash is dropped too."""
    if d.rank != 0 or config.metrics_path is None:
        return None
    path = Path(config.metrics_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if first == 0:
        return open(path, "w")  # noqa: SIM115 (closed in _loop's finally)
    kept, rerun = _metrics_before(path, first)
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)  # atomic: a crash now leaves the old file or the new one
    if rerun:
        print(f"mosaic: {rerun} step(s) after the checkpoint ran before the restart and run "
              f"again; their old lines are dropped from {path}", file=sys.stderr, flush=True)
    return open(path, "a")  # noqa: SIM115 (closed in _loop's finally)


def _metrics_before(path: Path, first: int) -> tuple[list[str], int]:
    try:
        lines = path.read_text().splitlines(keepends=True)
    except (OSError, UnicodeDecodeError):
        return [], 0
    kept, rerun = [], 0
    for line in lines:
        try:
            step = int(json.loads(line)["step"]) if line.endswith("\n") else None
        except (ValueError, KeyError, TypeError):
            step = None
        if step is not None and step < first:
            kept.append(line)
        elif step is not None:
            rerun += 1
    return kept, rerun


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
    launches = [s["launch_s"] for s in steps if not s["warmup"] and "launch_s" in s]
    launch = float(np.median(launches)) if launches else None
    plan = session.plan
    return {
        "model": graph.name, "preset": config.preset, "planner": plan.planner,
        "num_gpus": plan.num_gpus, "global_batch": graph.global_batch,
        "steps": config.steps, "warmup_steps": config.warmup_steps,
        "step_time_median_s": median,
        "step_time_p10_s": float(np.percentile(times, 10)),
        "step_time_p90_s": float(np.percentile(times, 90)),
        "samples_per_s": graph.global_batch / median if median > 0 else None,
        "mfu": (model_flops_utilisation(graph, d.world_size, config.hardware, median)
                if d.device.type == "cuda" else None),
        "host_launch_median_s": launch,
        "host_launch_share": launch / median if launch is not None and median > 0 else None,
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
                   engine: EngineConfig | None = None, warmup_steps: int = 2,
                   **fields: Any) -> TrainResult:
    """`mosaic train`: checks that the process count matches --gpus (torchrun or not);
    `fields`: the other TrainConfig fields, by name."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if gpus is not None and gpus != world:
        if "WORLD_SIZE" not in os.environ:
            raise TrainError(f"--gpus {gpus} needs {gpus} processes, one per GPU: launch with "
                             f"`torchrun --standalone --nproc-per-node {gpus} -m mosaic train ...`")
        raise TrainError(f"--gpus {gpus} but torchrun started {world} processes; make them equal")
    config = TrainConfig(model=model, preset=preset, plan_path=plan_path, steps=steps,
                         warmup_steps=min(warmup_steps, steps - 1), metrics_path=metrics,
                         engine=engine or EngineConfig(), **fields)
    return train(config)
