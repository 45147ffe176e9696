"""Measure several plans of one model, and the user's own program, in one process, fairly.

Every contender trains the SAME modules (one set of weights, one optimizer) on the same batch,
so a speedup is a ratio of two runs in one process, same model, batch, hardware and run. The
contenders are each plan (through `RankSession`, exactly as `mosaic train` runs it) and the
programs a user would otherwise write (`UserProgram`: eager, and `torch.compile` per module
with `mode="reduce-overhead"`, DDP across GPUs). Contenders are interleaved in rounds whose
order rotates, so clock or thermal drift cannot favour one.

Before timing, every contender must compute the same thing: its loss at identical weights
equals the reference's, and so does every module's gradient, within a tolerance measured in
the same run (the two user programs, eager and compiled, are the same math in different
kernels: their gradient difference is the noise floor). A plan that drops or scales a
module's gradients is refused, not measured.

Each round also runs every contender's steps in flight: a window of steps launched back to back,
read once at its end, as a training loop that logs every N steps runs them (`mosaic train`
does). Its mean step is reported beside the per-step median, with its own MFU and speedups;
the per-step median (a sync after each step, so the host's gap before each step is in it)
stays what the performance model is fitted on and what earlier results measured.

One process per GPU: run under `torchrun --nproc-per-node N` for N-GPU plans (gloo on CPU for a
logic check, NCCL on GPUs). A step's time is the slowest rank's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from mosaic.engine.bf16_optimizer import bf16_optimizer
from mosaic.engine.compile import CompileReport, compile_fn, compile_modules
from mosaic.engine.fsdp import gather_dtype
from mosaic.engine.main_weights import (
    STEPS_BEFORE_CAPTURE,
    bf16_weights_refusal,
    cast_weights_bf16,
)
from mosaic.engine.runner import REDUCE_DTYPES
from mosaic.engine.session import (
    Dist,
    EngineConfig,
    OverlappedOptimizer,
    RankSession,
    build_modules,
    end_distributed,
    launched_world_size,
    local_modules,
    make_batch,
    make_optimizer,
    start_distributed,
)
from mosaic.engine.signals import handling_sigterm
from mosaic.engine.tensor_parallel import full_tensor
from mosaic.engine.timer import Mark, Timer
from mosaic.engine.update_gates import GatedMainWeightsAdamW
from mosaic.engine.user_program import UserProgram
from mosaic.errors import MosaicError
from mosaic.files import portable_stem
from mosaic.graph import MMGraph
from mosaic.hardware import GPUSpec
from mosaic.plan import MEMORY_MARGIN, Plan, gpu_memory_bytes, plan_key, replica_bytes
from mosaic.provenance import git_sha, package_versions

log = logging.getLogger(__name__)

LOSS_TOLERANCE = 3e-2
"""Relative loss agreement between contenders under bf16 autocast (kernels differ per SM count)."""
GRAD_TOLERANCE_MIN = 1e-3
"""Floor of the gradient tolerance: fp32 on CPU agrees to ~1e-6, so this only guards noise."""
GRAD_TOLERANCE_FACTOR = 4.0
"""Tolerance = this x the measured eager-vs-compiled gradient difference (the noise floor)."""
GRAD_TOLERANCE_MAX = 0.2
"""A module whose gradients are dropped differs by 1.0: never tolerate that much."""
COMPILED_NOISE_FLOOR = 0.03
"""The eager-vs-compiled gradient difference assumed when no torch-compile program measures it:
measured 0.027-0.029 on the H200 under bf16 autocast (CLIP and ImageBind small); a plan compared
with the eager reference without it failed at 0.036 against a tolerance of 0.03."""
USER_PROGRAMS = {"torch-eager": None, "torch-compile": "reduce-overhead",
                 "torch-compile-max-autotune": "max-autotune",
                 "torch-compile-max-autotune-gemm": "reduce-overhead-max-autotune-gemm",
                 "torch-eager-fsdp": None, "torch-compile-fsdp": "default"}
"""The user's own program, by label: its torch.compile mode (None = eager). The max-autotune
ones ask Inductor to tune kernels (minutes of compiling): the fair comparisons when the engine
runs tuned kernels too (`--compile max-autotune-no-cudagraphs` / `max-autotune-gemm`)."""
FSDP_USER_PROGRAMS = ("torch-eager-fsdp", "torch-compile-fsdp")
"""User programs that shard their training states with FSDP2 instead of replicating them with
DDP (for models whose states fit on no one GPU): each trains its own copy of the modules with
its own optimizer, compiled without CUDA graphs, as torchtitan runs FSDP2."""
DEFAULT_USER_PROGRAMS = ("torch-eager", "torch-compile")
BASELINES = ("megatron", "distmm", "spindle")
USER_ROUNDS = ("interleaved", "apart", "alone")
VARIANT_FIELDS = ("grad_sync", "reduce_dtype", "bucket_view", "grads_in_graph",
                  "optimizer_overlap", "bf16_weights", "bf16_flat_grads", "bf16_moments",
                  "fp32_main_weights", "update_under_forward", "update_sms", "update_group",
                  "fp8_first_moment")
_INT_FIELDS = ("update_sms", "update_group")
_BOOL_FIELDS = ("bucket_view", "grads_in_graph", "optimizer_overlap", "bf16_weights",
                "bf16_flat_grads", "bf16_moments", "fp32_main_weights", "update_under_forward",
                "fp8_first_moment")
"""Engine settings a bench may vary per contender: gradient synchronisation, the optimizer
and the weights' precision (a bf16-weight contender trains its own copy of the modules)."""


class BenchError(MosaicError):
    """A benchmark that cannot run as asked; the message says the fix."""


class BenchStopped(BenchError):
    """The bench stopped before measuring every contender; what it measured by then
    (`measurements`, `checks`) still goes into the report, with `report_entry()` saying why."""

    measurements: list[PlanMeasurement]
    checks: dict[str, Any]

    def report_entry(self) -> tuple[str, dict[str, Any]]:
        """The report's key and value that say why it is incomplete."""
        raise NotImplementedError


class BenchInterrupted(BenchStopped):
    """SIGTERM (a time limit) stopped the bench: what was measured by then is kept."""

    def __init__(self, phase: str, elapsed_s: float, measurements: list[PlanMeasurement],
                 checks: dict[str, Any]) -> None:
        super().__init__(f"stopped by SIGTERM after {elapsed_s:.0f} s, after the phase "
                         f"{phase!r}; the results hold what was measured by then")
        self.phase, self.elapsed_s = phase, elapsed_s
        self.measurements, self.checks = measurements, checks

    def report_entry(self) -> tuple[str, dict[str, Any]]:
        return "interrupted", {"signal": "SIGTERM", "after_phase": self.phase,
                               "after_s": round(self.elapsed_s, 1)}


class GradientsDiffer(BenchStopped):
    """A contender's gradients differ from the reference's beyond the tolerance: it computes
    something else and is not timed. Kept for the report: the groups measured before, the
    checks made, and every contender's per-module differences (`checks["differences"]`)."""

    def __init__(self, message: str, label: str, module: str, difference: float,
                 tolerance: float) -> None:
        super().__init__(message)
        self.label, self.module, self.difference, self.tolerance = (label, module, difference,
                                                                    tolerance)
        self.measurements: list[PlanMeasurement] = []
        self.checks: dict[str, Any] = {}

    def report_entry(self) -> tuple[str, dict[str, Any]]:
        return "refused", self.to_dict()

    def to_dict(self) -> dict[str, Any]:
        return {"contender": self.label, "module": self.module, "difference": self.difference,
                "tolerance": self.tolerance, "message": str(self)}


class _Terminated(BaseException):
    """Raised by the SIGTERM handler. Not an Exception: a module's compile falls back to eager
    on any Exception, and a time limit must stop the bench, not one module's compile."""

    measured: tuple[list[PlanMeasurement], dict[str, Any]] | None = None
    """A group's measurements and checks, set when the signal came after its timed rounds."""


def _terminate() -> None:
    raise _Terminated


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    rounds: int = 6
    steps_per_round: int = 5
    warmup_steps: int = 5
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(graphs=True))
    """How every plan runs (CUDA graphs on by default: eager PyTorch is launch-bound)."""
    user_programs: tuple[str, ...] = DEFAULT_USER_PROGRAMS
    """The user's own programs to measure beside the plans (empty: plans only)."""
    user_rounds: str = "interleaved"
    """"interleaved": user programs share the timed rounds with the plans; "apart": the plans'
    rounds run first, then the user programs' own (same process, same weights and batch);
    "alone": the user programs are set up, checked and timed in a group of their own before
    the plans' (whose memory they then never share), and are the reference every plan group
    is judged against."""
    check_gradients: bool = True
    lr: float = 1e-5
    seed: int = 0
    nvml_seconds: float = 1.0
    """Seconds of extra steps per contender while NVML samples GPU utilisation (0: skip)."""
    in_flight_steps: int = 10
    """Per round, after its steps read one at a time, each contender runs this many steps back
    to back with no sync between them, as a training loop that reads its loss every N steps
    does (0: none). The per-step times (`median_s`) keep the sync after every step: the
    performance model is fitted on those, and they hold the host's gap before each step."""
    plans_at_once: int | None = None
    """None: every plan set up, captured and timed side by side (interleaved rounds). N: the
    plans in groups of N, each group built afresh from the same seed, measured, and released
    before the next: for models whose plans' CUDA graph pools do not fit on the GPU together,
    at the price of no interleaving across groups. The user programs go with the first group,
    whose reference loss and gradients (kept on the host) judge every later group."""
    torch_trace_dir: str | None = None
    """Where each contender's TRACED_STEPS timed steps are written as a torch.profiler trace
    (`<label>/trace-rank<r>.json.gz`; `mosaic bench` adds its kernel time by class beside
    it). None: none."""

    def __post_init__(self) -> None:
        if self.plans_at_once is not None and self.plans_at_once < 1:
            raise BenchError(f"plans_at_once={self.plans_at_once} must be >= 1 (or None: all)")
        for name in ("rounds", "steps_per_round"):
            if getattr(self, name) < 1:
                raise BenchError(f"{name}={getattr(self, name)} must be >= 1")
        if self.in_flight_steps < 0:
            raise BenchError(f"in_flight_steps={self.in_flight_steps} must be >= 0 (0: none)")
        unknown = set(self.user_programs) - set(USER_PROGRAMS)
        if unknown:
            raise BenchError(f"user_programs {sorted(unknown)}; choose from {list(USER_PROGRAMS)}")
        if self.user_rounds not in USER_ROUNDS:
            raise BenchError(f"user_rounds={self.user_rounds!r}; choose from {list(USER_ROUNDS)}")


@dataclass(slots=True)
class PlanMeasurement:
    label: str
    plan: Plan | None
    """None for a user program (it has no plan)."""
    step_times_s: list[float] = field(default_factory=list)
    launch_times_s: list[float] = field(default_factory=list)
    """Per timed step, the slowest rank's host seconds from the step's start until its
    optimizer step was launched: near the step time, the host is what bounds the step."""
    in_flight_step_times_s: list[float] = field(default_factory=list)
    """Per round, the mean step of BenchConfig.in_flight_steps steps run back to back (the
    slowest rank's window over its steps); empty when none were run."""
    pool: dict[str, Any] = field(default_factory=dict)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    """Each module's forward and backward start and end, seconds from the step's start (the
    median of TRACED_STEPS steps), in the results as `traced_step`: what perf.traced compares
    with the model stage by stage."""
    gpu_util: float | None = None
    grad_error: dict[str, float] = field(default_factory=dict)
    """Per module: relative gradient difference from the reference at identical weights."""
    startup_s: float = 0.0
    """This rank's seconds to build the plan's session and capture its graphs (0: a user program)."""
    same_plan_as: str | None = None
    """Another label whose plan is identical (plan_key): measured once, reported for both."""
    engine_variant: dict[str, Any] | None = None
    """The engine settings this contender ran with where they differ from the bench's own."""
    graph_memory_bytes: int | None = None
    """GPU memory its CUDA-graph capture kept (this rank; None on CPU or eager): the graphs'
    pools hold activations, weight casts and, graphed on one GPU, its own gradients."""
    graph_reserved_bytes: int | None = None
    """What the capture changed the allocator's reserved memory by. Not the pools' size:
    torch.cuda.graph empties the allocator's cache before it captures, so this can be
    negative (CLIP `small` b32, megatron: -1.5 GiB on the H200). See graph_pool_bytes."""
    graph_pool_bytes: int | None = None
    """Bytes of the private memory pools the capture created (allocator segments outside the
    default pool; activations included, though freed after each replay): what plans
    measured side by side must fit together."""
    torch_trace: str | None = None
    """The directory of its torch.profiler trace and kernel-time summary (BenchConfig)."""

    @property
    def median_s(self) -> float:
        return float(np.median(self.step_times_s))

    def summary(self) -> dict[str, Any]:
        t = np.array(self.step_times_s)
        return {
            "median_s": float(np.median(t)), "p10_s": float(np.percentile(t, 10)),
            "p90_s": float(np.percentile(t, 90)),
            "spread_s": float(np.percentile(t, 90) - np.percentile(t, 10)),
            "num_steps": len(t), "quotas_enforced": bool(self.pool.get("enforced")),
            "pool_backend": self.pool.get("backend", "-"), "measured_gpu_util": self.gpu_util,
            "max_grad_error": max(self.grad_error.values(), default=None),
            "same_plan_as": self.same_plan_as, "engine_variant": self.engine_variant,
            "graph_memory_bytes": self.graph_memory_bytes,
            "graph_reserved_bytes": self.graph_reserved_bytes,
            "graph_pool_bytes": self.graph_pool_bytes, "torch_trace": self.torch_trace,
            **self._launch_summary(), **self._in_flight_summary(),
            "traced_step": [{**e, "start_s": round(e["start_s"], 7), "end_s": round(e["end_s"], 7)}
                            for e in self.timeline],
        }

    @property
    def in_flight_median_s(self) -> float | None:
        """The median of its windows' mean step (None: no steps were run in flight)."""
        times = self.in_flight_step_times_s
        return float(np.median(times)) if times else None

    def _in_flight_summary(self) -> dict[str, Any]:
        return {"in_flight_median_s": self.in_flight_median_s,
                "in_flight_windows": len(self.in_flight_step_times_s)}

    def _launch_summary(self) -> dict[str, Any]:
        if not self.launch_times_s:
            return {"host_launch_median_s": None, "host_launch_share": None}
        launch = float(np.median(self.launch_times_s))
        return {"host_launch_median_s": launch, "host_launch_share": launch / self.median_s}


# --- contenders: one step function per plan or user program -----------------------------------
@dataclass(slots=True)
class _Contender:
    label: str
    step: Callable[[], torch.Tensor]
    """Forward + backward on this contender's data; returns this rank's loss share."""
    params: list[nn.Parameter]
    """Parameters whose gradients this contender produces on this rank."""
    data: Any = None
    """This rank's samples (they depend on the placement)."""
    session: RankSession | None = None
    program: UserProgram | None = None
    startup_s: float = 0.0
    modules: dict[str, nn.Module] | None = None
    """Its own modules, when the plans' shared ones cannot serve it (a plan that shards)."""
    optimizer: torch.optim.Optimizer | None = None
    """The optimizer of its own modules (else the shared one steps)."""
    last_end: Mark | None = None
    """Where its last timed step ended (a deferred update's next step is timed from it)."""
    graph_memory_bytes: int | None = None
    graph_reserved_bytes: int | None = None
    graph_pool_bytes: int | None = None


@dataclass(slots=True)
class _Reference:
    """What groups of plans (`plans_at_once`) are all checked against: the first group's
    reference loss and per-module gradients at the seed's weights, the gradients copied to the
    host. A later group, set up afresh from the same seed, is judged against these numbers;
    judged against its own first plan, a lone plan would always agree with itself."""
    loss_label: str
    loss: float
    grad_label: str | None = None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    grad_checks: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _Setup:
    dist: Dist
    contenders: dict[str, _Contender]
    optimizer: torch.optim.Optimizer | None
    params: list[nn.Parameter]
    modules: dict[str, nn.Module]
    compiled: CompileReport
    timer: Timer
    batch: dict[str, tuple[torch.Tensor, ...]]
    graph: MMGraph
    engine: EngineConfig

    @property
    def device(self) -> torch.device:
        return self.dist.device


def _plan_contender(label: str, session: RankSession, batch: dict) -> _Contender:
    data = session.local_batch(batch)
    return _Contender(label, lambda: session.step(data).loss, session.parameters(), data,
                      session=session)


def _user_contender(label: str, program: UserProgram, batch: dict) -> _Contender:
    data = program.local_batch(batch)
    return _Contender(label, lambda: program.step(data), program.parameters(), data,
                      program=program)


def _setup(model, preset: str, graph: MMGraph, plans: dict[str, Plan], gpu: GPUSpec,
           config: BenchConfig, engines: dict[str, EngineConfig]) -> _Setup:
    d = start_distributed(None)
    for label, plan in plans.items():
        if plan.num_gpus != d.world_size:
            raise BenchError(f"plan {label!r} uses {plan.num_gpus} GPUs but {d.world_size} "
                             f"process(es) run: launch `torchrun --standalone --nproc-per-node "
                             f"{plan.num_gpus} -m mosaic bench ...`")
    shared_bf16 = _shares_bf16_weights(config)

    def own_copy(label: str, plan: Plan) -> bool:
        return _reshapes(plan) or engines.get(label, config.engine).bf16_weights != shared_bf16

    # A user program holds the whole model on every rank, as DDP does. A group of own copies
    # alone builds no shared modules: at `paper` they would not fit beside the copies.
    shared = [plan for label, plan in plans.items() if not own_copy(label, plan)]
    replicated = set(config.user_programs) - set(FSDP_USER_PROGRAMS)
    names = graph.names if replicated else local_modules(shared, d.rank)
    modules = build_modules(model, preset, names, config.seed, d.device)
    engine = _on_device(config.engine, d)
    if shared_bf16:
        cast_weights_bf16(modules.values())
    views, compiled = compile_modules(modules, engine.compile, scope=engine.compile_scope)
    batch = make_batch(model, preset, graph.global_batch, config.seed, 0)
    contenders: dict[str, _Contender] = {}
    try:
        for label, plan in plans.items():
            start = time.perf_counter()
            own_engine = _on_device(engines.get(label, config.engine), d)
            if own_copy(label, plan):
                contenders[label] = _own_contender(label, plan, model, preset, graph, d, gpu,
                                                   own_engine, config, compiled, batch)
            else:
                if shared_bf16:
                    _check_bf16_weights(label, plan, own_engine)
                session = RankSession.create(plan, graph, modules, d, gpu, own_engine, views=views)
                contenders[label] = _plan_contender(label, session, batch)
                if own_engine.optimizer_overlap:  # its own optimizer state; same weights
                    contenders[label].optimizer = OverlappedOptimizer(
                        session, _optimizer_maker(own_engine, config.lr))
                elif own_engine.update_under_forward:  # likewise
                    contenders[label].optimizer = _optimizer_maker(
                        own_engine, config.lr, session)(session.parameters())
            contenders[label].startup_s = time.perf_counter() - start
    except BaseException:
        _close(contenders)
        raise
    params = [p for m in modules.values() for p in m.parameters()]
    optimizer = _optimizer_maker(engine, config.lr)(params) if params else None
    return _Setup(d, contenders, optimizer, params, modules, compiled, Timer(d.device), batch,
                  graph, engine)


def _shares_bf16_weights(config: BenchConfig) -> bool:
    """Whether the plans share one bf16-weight copy of the modules and one main-weights
    optimizer, as fp32 plans share theirs: when the bench's own engine keeps bf16 weights
    (autotune under `mosaic train --bf16-weights`) and no user program (fp32 weights under
    autocast) needs the modules in fp32. A copy each would hold 16 bytes a parameter per
    plan: at `paper` scale, more than the GPU."""
    return config.engine.bf16_weights and not config.user_programs


def _on_device(engine: EngineConfig, d: Dist) -> EngineConfig:
    return engine if d.device.type == "cuda" else replace(engine, graphs=False)


def engine_variant(base: EngineConfig, settings: dict[str, Any]) -> EngineConfig:
    """`base` with the settings of one `--engine-variant` (checked)."""
    unknown = set(settings) - set(VARIANT_FIELDS)
    if unknown:
        raise BenchError(f"engine variant fields {sorted(unknown)}: a variant may change only "
                         f"{', '.join(VARIANT_FIELDS)} (the modules are compiled once for all)")
    if settings.get("bf16_weights") and base.amp is False:
        raise BenchError("engine variant bf16_weights=true needs bf16 autocast: leave amp on")
    try:
        engine = replace(base, **settings)
        engine.runner_config()  # the runner's own checks, now rather than at set-up
        return engine
    except MosaicError as exc:
        raise BenchError(f"engine variant {settings}: {exc}") from None


def parse_variant(text: str) -> dict[str, Any]:
    """`--engine-variant "grad_sync=bucketed,bucket_view=false"` -> the settings, typed."""
    settings: dict[str, Any] = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        key, sep, value = item.partition("=")
        if not sep:
            raise BenchError(f"--engine-variant {text!r}: write FIELD=VALUE[,FIELD=VALUE], e.g. "
                             "grad_sync=bucketed")
        key, value = key.strip(), value.strip()
        if key in _BOOL_FIELDS:
            if value.lower() not in ("true", "false"):
                raise BenchError(f"--engine-variant {text!r}: {key} is true or false")
            settings[key] = value.lower() == "true"
        elif key in _INT_FIELDS:
            if not value.isdigit():
                raise BenchError(f"--engine-variant {text!r}: {key} is a whole number")
            settings[key] = int(value)
        else:
            settings[key] = value
    return settings


def variant_label(label: str, settings: dict[str, Any]) -> str:
    return label + "@" + ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                                  for k, v in settings.items())


def synchronises_gradients(plan: Plan) -> bool:
    """Whether some module of `plan` is data-parallel (so gradient-sync settings matter)."""
    return any(p.dp_degree > 1 for st in plan.stages for p in st.placements)


def variant_applies(plan: Plan, settings: dict[str, Any]) -> bool:
    """Whether an engine variant changes how `plan` runs: gradient accumulation in the graphs,
    the optimizer's overlap and bf16 weights matter to every plan, the gradient-sync settings
    to data-parallel ones only."""
    every_plan = {"grads_in_graph", "optimizer_overlap", "bf16_weights", "bf16_flat_grads",
                  "bf16_moments", "fp32_main_weights", "update_under_forward", "update_sms",
                  "update_group", "fp8_first_moment"}
    return bool(every_plan & set(settings)) or synchronises_gradients(plan)


def _reshapes(plan: Plan) -> bool:
    """Whether `plan` turns parameters into shards in place (FSDP2 or tensor parallelism)."""
    return any(p.shard or p.tensor_parallel > 1 for st in plan.stages for p in st.placements)


def _own_contender(label: str, plan: Plan, model, preset: str, graph: MMGraph, d: Dist,
                   gpu: GPUSpec, engine: EngineConfig, config: BenchConfig,
                   compiled: CompileReport, batch: dict) -> _Contender:
    """A plan that shards its modules in place, or stores its weights in another precision
    than the shared modules', trains its own copy of them (the same weights: same seed) with
    its own optimizer, so the other plans keep theirs whole."""
    if engine.bf16_weights:
        _check_bf16_weights(label, plan, engine)
    own = build_modules(model, preset, local_modules(plan, d.rank), config.seed, d.device)
    if engine.bf16_weights:
        cast_weights_bf16(own.values())
    views, _ = compile_modules(own, engine.compile, compiled, engine.compile_scope)
    session = RankSession.create(plan, graph, own, d, gpu, engine, views=views)
    contender = _plan_contender(label, session, batch)
    contender.modules = own
    make = _optimizer_maker(engine, config.lr, session)
    contender.optimizer = (OverlappedOptimizer(session, make) if engine.optimizer_overlap
                           else make(session.parameters()))
    return contender


def _optimizer_maker(engine: EngineConfig, lr: float, session: RankSession | None = None,
                     ) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """What a contender of `engine` trains its parameters with: AdamW over fp32 main weights
    where the weights are bf16 (gated by `session`'s update gates when it has them), else
    torch's fused AdamW."""
    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if session is not None and session.gates is not None:
            return GatedMainWeightsAdamW(params, lr, gates=session.gates, moments=engine.moments)
        if engine.bf16_weights:
            return bf16_optimizer(params, lr, moments=engine.moments,
                                  fp32_main_weights=engine.fp32_main_weights,
                                  update_group=engine.update_group,
                                  fp8_first_moment=engine.fp8_first_moment)
        return make_optimizer("adamw", params, lr)
    return make


def _check_bf16_weights(label: str, plan: Plan, engine: EngineConfig) -> None:
    refusal = bf16_weights_refusal(plan, amp=engine.amp, reduce_dtype=engine.reduce_dtype,
                                   grad_sync=engine.grad_sync)
    if refusal:
        raise BenchError(f"{label!r}: {refusal}")


def user_program_bytes(graph: MMGraph, label: str, world_size: int,
                       accumulation: int = 1) -> float:
    """Peak bytes per GPU of user program `label` by the plans' memory model: every module's
    fp32 training states, whole (DDP) or sharded over the world (FSDP2), its bf16 weight copies
    and activations at one micro-step's share of the batch."""
    fp32 = graph.with_precision(bf16_weights=False)
    shard = label in FSDP_USER_PROGRAMS and world_size > 1
    return sum(replica_bytes(m, graph.global_batch // accumulation, world_size, shard=shard)
               for m in fp32.modules)


def user_programs_that_fit(graph: MMGraph, labels: tuple[str, ...], world_size: int,
                           gpu: GPUSpec, accumulation: int = 1,
                           ) -> tuple[tuple[str, ...], dict[str, str]]:
    """The user programs the memory model says fit on `gpu`, and why each other one does not
    (it is not built: the plans are measured without it, and the report says so)."""
    budget = gpu.memory_bytes * (1 - MEMORY_MARGIN)
    kept, left_out = [], {}
    for label in labels:
        need = user_program_bytes(graph, label, world_size, accumulation)
        if need <= budget:
            kept.append(label)
            continue
        if label in FSDP_USER_PROGRAMS:
            how, fix = f"sharded over {world_size} GPUs (FSDP2)", "more GPUs or a smaller --batch"
        elif world_size < 2:
            how, fix = "whole on every GPU (DDP)", "more GPUs, with torch-compile-fsdp"
        else:
            fsdp = user_program_bytes(graph, "torch-compile-fsdp", world_size, accumulation)
            how = "whole on every GPU (DDP)"
            fix = f"torch-compile-fsdp (FSDP2 shards them: about {fsdp / 2**30:.1f} GiB)"
        left_out[label] = (f"needs about {need / 2**30:.1f} GiB per GPU (every module's "
                           f"training states {how}, and activations at "
                           f"{graph.global_batch // (world_size * accumulation)} samples) but "
                           f"{budget / 2**30:.1f} GiB is usable on {gpu.name}; it would run "
                           f"with {fix}")
    return tuple(kept), left_out


def _add_user_programs(s: _Setup, config: BenchConfig, model, preset: str) -> None:
    """After the plans' CUDA-graph capture: a DDP built earlier keeps each parameter's
    gradient accumulator on the main (legacy) stream, and capturing a backward that reaches
    it then fails on the H200 ("operation would make the legacy stream depend on a capturing
    blocking stream"). An FSDP2 program shards its modules in place, so it gets its own copy
    (same seed, same weights) and its own optimizer. Gradients are reduced in the engine's
    precision, and a step is as many micro-steps as the plans' (`--accumulation`)."""
    for label in config.user_programs:
        sharded = label in FSDP_USER_PROGRAMS
        modules = (build_modules(model, preset, s.graph.names, config.seed, s.device) if sharded
                   else s.modules)
        program = UserProgram(graph=s.graph, modules=modules, compile_mode=USER_PROGRAMS[label],
                              device=s.device, amp=s.engine.amp,
                              compile_fn=user_compile_fn(s.compiled, label), shard_states=sharded,
                              reduce_dtype=REDUCE_DTYPES[s.engine.reduce_dtype],
                              accumulation=s.engine.accumulation)
        contender = _user_contender(label, program, s.batch)
        if sharded:
            contender.modules = modules
            contender.optimizer = _optimizer_maker(replace(s.engine, bf16_weights=False),
                                                   config.lr)(program.parameters())
        s.contenders[label] = contender


def user_compile_fn(report: CompileReport, label: str):
    """The user program compiles each module whole, whatever the engine's compile scope: the
    baseline is torch.compile(mode="reduce-overhead") per module. Compiled by blocks, its
    CUDA graphs split at every layer with eager code between them: on OFASys `paper` it ran
    at 167.8 ms a step against 82.4 ms whole (H200, 2026-12-01), no baseline to beat."""
    return compile_fn(report, "module", label)


def _close(contenders: dict[str, _Contender]) -> None:
    for c in contenders.values():
        if c.session is not None:
            c.session.close()


def _zero_grads(s: _Setup) -> None:
    own = [p for c in s.contenders.values() if c.modules is not None for p in c.params]
    for p in s.params + own:
        p.grad = None


def _world_sum(values: list[float], device: torch.device, op: str = "sum") -> list[float]:
    """Reduce a few floats over the whole world (host sync: outside timed regions)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return [float(v) for v in t.tolist()]


def _name(error: RuntimeError, label: str, when: str) -> None:
    """Mark `error` with the contender whose step raised it: the plans share one process, so
    a CUDA error alone does not say whose kernels failed (`error.contender`, and a note)."""
    error.contender = label
    error.add_note(f"mosaic bench: raised in {label!r}'s step, {when}")


def _step(c: _Contender) -> torch.Tensor:
    """c's forward and backward outside the timed rounds, each ending in a sync, so a CUDA
    fault raised here is this contender's (or, launched asynchronously, one since the last)."""
    try:
        return c.step()
    except RuntimeError as error:
        _name(error, c.label, "checking it against the others")
        raise


# --- equivalence: losses and gradients at identical weights ------------------------------------
def _losses(s: _Setup) -> dict[str, float]:
    """Every contender's loss at the current (identical) weights, summed over ranks; no update."""
    losses = {}
    for label, c in s.contenders.items():
        _zero_grads(s)
        (losses[label],) = _world_sum([float(_step(c).item())], s.device)
    _zero_grads(s)
    return losses


def _check_losses(when: str, losses: dict[str, float], reference: _Reference | None = None) -> None:
    first, ref = ((reference.loss_label, reference.loss) if reference is not None
                  else next(iter(losses.items())))
    for label, value in losses.items():
        if not math.isfinite(value) or abs(value - ref) > LOSS_TOLERANCE * max(1.0, abs(ref)):
            raise BenchError(f"{when}: {label!r} gives loss {value:.5f} but {first!r} gives "
                             f"{ref:.5f} at the same weights; it computes something else")


def _held_params(s: _Setup, c: _Contender) -> dict[str, list[nn.Parameter]]:
    """The parameters this contender trains on this rank, per module, in module order."""
    held = {id(p) for p in c.params}
    per_module = {name: [p for p in module.parameters() if id(p) in held]
                  for name, module in (c.modules or s.modules).items()}
    return {name: params for name, params in per_module.items() if params}


def _reference_grads(s: _Setup, c: _Contender) -> dict[str, torch.Tensor]:
    """One flat fp32 gradient per module the reference trains on this rank, on the host
    (zeros where a parameter got none), after one forward and backward at the current
    weights. On the host: beside each contender's own gradients on the GPU it would need room
    for two models' gradients (Qwen3-VL `paper`'s LLM: 32 GB each)."""
    _zero_grads(s)
    _step(c)
    grads = {name: _flat_grad(params, torch.device("cpu"))
             for name, params in _held_params(s, c).items()}
    _zero_grads(s)
    return grads


def _flat_grad(params: list[nn.Parameter], device: torch.device) -> torch.Tensor:
    """The parameters' whole gradients, fp32, in one flat tensor on `device` (zeros where
    none), written into it one parameter at a time: a shard's gradient is gathered whole (a
    collective over its mesh), and a module's gradients gathered whole at once would need
    its size again on the GPU."""
    flat = torch.zeros(sum(p.numel() for p in params), device=device)
    start = 0
    for p in params:
        if p.grad is not None:
            flat[start:start + p.numel()].copy_(full_tensor(p.grad).detach().reshape(-1))
        start += p.numel()
    return flat


def _relative_errors(s: _Setup, c: _Contender, ref: dict[str, torch.Tensor],
                     names: list[str]) -> dict[str, float]:
    """Per module ||g - g_ref|| / ||g_ref|| after one forward and backward of `c` at the
    current weights, the worst over the ranks that hold it. Compared a parameter at a time:
    a sharded module's gradient is gathered one parameter at a time, never whole."""
    _zero_grads(s)
    _step(c)
    held = _held_params(s, c)
    local = []
    for name in names:
        if name in held and name in ref:
            norm, diff = _module_norm_and_distance(ref[name], held[name], s.device)
            local.append(diff / norm if norm > 0 else diff)
        else:
            local.append(-1.0)  # not held here: the MAX over ranks ignores it
    _zero_grads(s)
    worst = _world_sum(local, s.device, op="max")
    return {n: e for n, e in zip(names, worst, strict=True) if e >= 0}


COMPARE_CHUNK = 1 << 26
"""Elements of a reference gradient kept on the host that are moved to the device at once."""


def _module_norm_and_distance(ref: torch.Tensor, params: list[nn.Parameter],
                              device: torch.device) -> tuple[float, float]:
    """||ref|| and ||g - ref|| for the flat reference `ref` of a module whose parameters
    are `params` (g: their gradients, zero where none), one parameter at a time."""
    squares = torch.zeros(2, dtype=torch.float64, device=device)
    start = 0
    for p in params:
        part = ref[start:start + p.numel()]
        grad = full_tensor(p.grad).detach().reshape(-1) if p.grad is not None else None
        _add_squares(squares, part, grad, device)
        start += p.numel()
    norm, diff = squares.sqrt().tolist()
    return norm, diff


def _add_squares(squares: torch.Tensor, ref: torch.Tensor, grad: torch.Tensor | None,
                 device: torch.device) -> None:
    """Adds ||ref||^2 and ||grad - ref||^2 to `squares` (no gradient: zeros), the reference
    moved to `device` a chunk at a time (a later plan group's reference lives on the host: a
    copy of it whole on the GPU would sit beside the plan's own states)."""
    for start in range(0, ref.numel(), COMPARE_CHUNK):
        part = ref[start:start + COMPARE_CHUNK].to(device).double()
        squares[0] += part.square().sum()
        difference = part if grad is None else grad[start:start + COMPARE_CHUNK].double() - part
        squares[1] += difference.square().sum()


def _check_gradients(s: _Setup, names: list[str], stored: _Reference | None = None,
                     ) -> tuple[dict[str, dict[str, float]], dict, dict[str, torch.Tensor]]:
    """Gradient error of every contender against the reference (this group's, or the one an
    earlier group `stored`), the checks made (reference, noise floor, tolerance, modules no
    rank could compare), and the reference's gradients on this rank (on the host)."""
    labels = list(s.contenders)
    if stored is not None and stored.grad_label is not None:
        reference, ref = stored.grad_label, stored.grads
    else:
        reference = "torch-eager" if "torch-eager" in labels else labels[0]
        ref = _reference_grads(s, s.contenders[reference])
    errors = {label: _relative_errors(s, s.contenders[label], ref, names) for label in labels}
    checks = (dict(stored.grad_checks) if stored is not None and stored.grad_label is not None
              else _gradient_tolerance(s, reference, errors))
    unchecked = {label: sorted(set(names) - set(e)) for label, e in errors.items()
                 if set(names) - set(e)}
    if unchecked:  # a plan-only bench on several ranks: the reference plan held other modules
        log.warning("gradients not compared (no rank held both): %s", unchecked)
        checks["unchecked"] = unchecked
    if "reference_kernels" not in checks:
        checks["reference_kernels"] = _kernel_class(s.contenders[reference])
    checks["other_kernels"] = [label for label in labels if _kernel_class(s.contenders[label])
                               != checks["reference_kernels"]]
    try:
        _refuse_differing(errors, reference, checks)
    except GradientsDiffer as refused:
        refused.checks = {**checks, "differences": errors}
        raise
    return errors, checks, ref


def _kernel_class(c: _Contender) -> str:
    """bf16 weights compile other kernels than fp32 weights under autocast (no weight casts,
    other fusions), so their gradients differ from an fp32 contender's as much as compiled
    ones from eager ones (Qwen3-VL `small` b8 on the H200: 0.019 and 0.020 per module; fp32
    compiled plans from each other 0.0007). The FSDP2 user program, and a plan that shards
    a module under autocast, compute with bf16 weights too (gathered in bf16:
    fsdp.gather_dtype); the whole plan's gradients then get the looser tolerance."""
    session = c.session
    bf16 = ((session is not None and session.config.bf16_weights)  # alike on every rank
            or (session is not None and session.plan.sharded_modules()
                and gather_dtype(session.runner.amp) == torch.bfloat16)
            or (c.program is not None and c.program.param_dtype == torch.bfloat16))
    return "bf16 weights" if bf16 else "fp32 weights"


def _gradient_tolerance(s: _Setup, reference: str, errors: dict[str, dict[str, float]]) -> dict:
    """The tolerance: a multiple of the eager-vs-compiled difference measured in this run
    (torch-compile against torch-eager), else of the difference assumed for these kernels,
    and never below the reference's own run-to-run difference (its gradients are taken by a
    second step: kernels with atomics differ between runs; Unified-IO 2 `paper`'s audio
    encoder by 0.006 on the H200). Against a compiled reference, torch-compile's difference is
    that of the same kernels, so it bounds only contenders of the reference's kernel class;
    the others (`_kernel_class`) get `tolerance_other_kernels`, from the eager-vs-compiled
    difference assumed."""
    rerun = max(errors.get(reference, {}).values(), default=0.0)
    floor = (max(rerun, *errors["torch-compile"].values()) if "torch-compile" in errors
             else None)
    assumed = (0.0 if s.device.type == "cpu" else
               COMPILED_NOISE_FLOOR if s.engine.compile else LOSS_TOLERANCE / GRAD_TOLERANCE_FACTOR)
    tolerance = _tolerance(max(assumed, rerun) if floor is None else floor)
    same_kernels = s.engine.compile and reference != "torch-eager" and floor is not None
    return {"reference": reference, "noise_floor": floor, "rerun_difference": rerun,
            "tolerance": tolerance,
            "tolerance_other_kernels": max(tolerance, _tolerance(assumed)) if same_kernels
            else tolerance}


def _tolerance(floor: float) -> float:
    return min(GRAD_TOLERANCE_MAX, max(GRAD_TOLERANCE_MIN, GRAD_TOLERANCE_FACTOR * floor))


def _refuse_differing(errors: dict[str, dict[str, float]], reference: str,
                      checks: dict[str, Any]) -> None:
    floor = checks.get("noise_floor")
    for label, per_module in errors.items():
        other = label in checks.get("other_kernels", ())
        tolerance = checks["tolerance_other_kernels" if other else "tolerance"]
        bad = {m: e for m, e in per_module.items() if not e <= tolerance}
        if bad:
            worst = max(bad, key=bad.get)
            every = ", ".join(f"{m} {e:.3g}" for m, e in per_module.items())
            basis = (f"{GRAD_TOLERANCE_FACTOR:g} x the measured noise floor {floor:.3g}"
                     if floor is not None and not other else "assumed for these kernels")
            raise GradientsDiffer(f"{label!r}: the gradient of module {worst!r} differs from "
                                  f"{reference!r}'s by {bad[worst]:.3g} (relative; tolerance "
                                  f"{tolerance:.3g}, {basis}) at the same weights; it computes "
                                  f"something else (every module: {every})",
                                  label, worst, bad[worst], tolerance)


# --- timing ------------------------------------------------------------------------------------
def _one_step(s: _Setup, c: _Contender, since: Mark | None = None) -> tuple[float, float]:
    """Seconds of one training step on the slowest rank, and the most host seconds a rank
    took to launch it (forward, backward and optimizer step issued). `since`: time it from
    there (the end of the step before), not from its own start."""
    _zero_grads(s)
    try:
        start, launch_start = since or s.timer.mark(), time.perf_counter()
        loss = c.step()
        optimizer = c.optimizer or s.optimizer
        if optimizer is not None:
            optimizer.step()
        launch = time.perf_counter() - launch_start
        c.last_end = s.timer.mark()
        seconds = s.timer.seconds(start, c.last_end)
        finite = math.isfinite(loss.item())
    except RuntimeError as error:  # CUDA faults surface at the next sync: say whose step it was
        _name(error, c.label, "while timing it (a step ends in a sync, so the fault is in "
              "its step or optimizer step)")
        raise
    if not finite:
        raise BenchError(f"{c.label!r}: loss became non-finite; lower --lr")
    slowest, launch = _world_sum([seconds, launch], s.device, op="max")
    return slowest, launch


def _round_groups(s: _Setup, config: BenchConfig) -> list[list[str]]:
    """Labels timed together: all of them, or the plans and then the user programs."""
    labels = list(s.contenders)
    if config.user_rounds == "interleaved":
        return [labels]
    plans = [label for label in labels if s.contenders[label].program is None]
    users = [label for label in labels if s.contenders[label].program is not None]
    return [group for group in (plans, users) if group]


@dataclass(slots=True)
class _Timings:
    """What the timed rounds measured, per label."""

    steps: dict[str, list[tuple[float, float]]]
    """(step seconds, host launch seconds) of every step read one at a time."""
    in_flight: dict[str, list[float]]
    """Per round, the mean step of a window of steps run back to back."""


def _timed_rounds(s: _Setup, config: BenchConfig) -> _Timings:
    """Every contender's timed steps, its labels' order rotated each round."""
    timings = _Timings({label: [] for label in s.contenders}, {label: [] for label in s.contenders})
    for labels in _round_groups(s, config):
        for label in labels:
            for _ in range(_warmup_steps(s, s.contenders[label], config)):
                _one_step(s, s.contenders[label])
        for r in range(config.rounds):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                c = s.contenders[label]
                timings.steps[label] += _timed_steps(s, c, config.steps_per_round)
                if config.in_flight_steps:
                    timings.in_flight[label].append(_in_flight_step(s, c, config.in_flight_steps))
    return timings


def _timed_steps(s: _Setup, c: _Contender, steps: int) -> list[tuple[float, float]]:
    """`steps` steps of `c` in a row. A contender whose update runs under the next step's
    forward (update_gates.py) leaves its update running when a step's stream is done, so
    its step is timed from the end of the step before (one untimed step first): a window
    that holds what the next forward waited for of that update, and the host's gap between
    the steps, which a training loop without a sync each step would not have."""
    with _updates_deferred(s, c) as deferred:
        if not deferred:
            return [_one_step(s, c) for _ in range(steps)]
        _one_step(s, c)
        return [_one_step(s, c, since=c.last_end) for _ in range(steps)]


def _in_flight_step(s: _Setup, c: _Contender, steps: int) -> float:
    """Seconds a step of `steps` steps launched back to back on the slowest rank: the host
    runs ahead of the GPU, as in a training loop that reads its loss every N steps, so what
    the host does between steps hides under the GPU's work. The window starts idle (after a
    sync), so it holds one step's launch latency, and ends when the last step's update is
    done; the losses are summed on the GPU (as a loop that logs their mean) and read once."""
    optimizer = c.optimizer or s.optimizer
    with _updates_deferred(s, c) as deferred:
        try:
            # Summed into a tensor of its own: a graphed step's loss is a static output that
            # its next replay overwrites (torch.compile's CUDA graph trees refuse a read then).
            start, total = s.timer.mark(), torch.zeros((), device=s.device)
            for _ in range(steps):
                _zero_grads(s)
                total += c.step().detach().float().sum()
                if optimizer is not None:
                    optimizer.step()
            if deferred:
                optimizer.settle()
            seconds = s.timer.seconds(start, s.timer.mark())
            finite = math.isfinite(total.item())
        except RuntimeError as error:
            _name(error, c.label, f"while timing {steps} steps in flight (the fault is in one "
                  "of them)")
            raise
    if not finite:
        raise BenchError(f"{c.label!r}: loss became non-finite; lower --lr")
    (slowest,) = _world_sum([seconds], s.device, op="max")
    return slowest / steps


@contextlib.contextmanager
def _updates_deferred(s: _Setup, c: _Contender) -> Iterator[bool]:
    """Whether `c`'s update is left to run under its next step's forward inside; after, it
    is waited for, so it runs under no other contender's step."""
    optimizer = c.optimizer or s.optimizer
    deferred = isinstance(optimizer, GatedMainWeightsAdamW) and c.session.runner.grads_stay_put
    if isinstance(optimizer, GatedMainWeightsAdamW) and not deferred:
        warnings.warn(f"{c.label!r}: its update waits for itself each step (some module's "
                      "gradients are not left in place by a CUDA graph)", stacklevel=3)
    if not deferred:
        yield False
        return
    optimizer.defer = True
    try:
        yield True
    finally:
        optimizer.defer = False
        optimizer.settle()


def _warmup_steps(s: _Setup, c: _Contender, config: BenchConfig) -> int:
    """Untimed steps before `c`'s timed rounds: at least enough for a plan's optimizer to
    capture its update (MainWeightsAdamW: after STEPS_BEFORE_CAPTURE steps in a row with the
    same gradients, on a GPU). With fewer, as autotune's two, its first round updated eagerly
    and captured while timed: autotune on the H200 timed CLIP `small` b32 updating a weight
    at a time at 18.86 ms a step (2026-12-03), 8.33 once warmed up (its flat update 8.15)."""
    if c.session is not None and s.device.type == "cuda":  # a plan, not a user's program
        return max(config.warmup_steps, STEPS_BEFORE_CAPTURE + 1)
    return config.warmup_steps


TRACED_STEPS = 3
"""Steps whose module timeline is recorded after timing; each event is their median (one step
jitters by tenths of a millisecond, the size of a small module's phase)."""


def _timeline(s: _Setup, c: _Contender) -> list[dict[str, Any]]:
    """The plan's module timeline (start and end of each module's forward and backward, every
    rank's gathered), each event the median over TRACED_STEPS steps."""
    if c.session is None:
        return []
    runner = c.session.runner
    runner.record_timeline = True
    steps = []
    try:
        for _ in range(TRACED_STEPS):
            _zero_grads(s)
            out = c.session.step(c.data)
            if (optimizer := c.optimizer or s.optimizer) is not None:
                optimizer.step()  # its own, for a plan that trains its own modules
            steps.append(runner.timeline(out))
    finally:
        runner.record_timeline = False
    events = median_events(steps)
    if s.dist.world_size > 1:
        gathered: list[Any] = [None] * s.dist.world_size
        dist.all_gather_object(gathered, events)
        events = [e for part in gathered for e in part]
    return events


def median_events(steps: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One event per (module, stage, phase, GPU) with the median start and end over steps."""
    by_key: dict[tuple, list[dict[str, Any]]] = {}
    for events in steps:
        for e in events:
            by_key.setdefault((e["module"], e["stage"], e["phase"], e["gpu"]), []).append(e)
    return [{**same[0], "start_s": float(np.median([e["start_s"] for e in same])),
             "end_s": float(np.median([e["end_s"] for e in same]))}
            for same in by_key.values()]


def _torch_trace(s: _Setup, c: _Contender, directory: str | None) -> str | None:
    """TRACED_STEPS of `c`'s timed steps under torch.profiler, written per rank; the
    directory. Each step ends in a sync, as when timed, so each holds its own kernels only
    (`mosaic bench` then summarises them, as `mosaic train --torch-trace` does)."""
    if directory is None:
        return None
    from torch.profiler import ProfilerActivity, profile, record_function

    out = Path(directory) / portable_stem(c.label)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.device.type == "cuda"
                                           else [])
    with _updates_deferred(s, c) as deferred:
        if deferred:  # untraced: the first traced step holds this one's update, as each after
            _one_step(s, c)
        with profile(activities=activities) as prof:
            for i in range(TRACED_STEPS):  # the marks `mosaic kernel-time` counts steps by
                with record_function(f"ProfilerStep#{i}"):
                    _one_step(s, c)
    prof.export_chrome_trace(str(out / f"trace-rank{s.dist.rank}.json.gz"))
    return str(out)


def _nvml_util(s: _Setup, c: _Contender, seconds: float) -> float | None:
    """Mean NVML GPU utilisation over the GPUs while only this contender runs (per device, not
    per SM). Every rank runs the same number of steps, so collectives stay matched."""
    if s.device.type != "cuda" or seconds <= 0:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    except Exception:  # NVML is optional: no library, no permission
        return None
    samples: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    step_s = _one_step(s, c)[0]
    (steps,) = _world_sum([max(1.0, round(seconds / max(1e-4, step_s)))], s.device, "max")
    for _ in range(int(steps)):
        _one_step(s, c)
    stop.set()
    thread.join()
    pynvml.nvmlShutdown()
    mean = float(np.mean(samples)) / 100 if samples else 0.0
    (total,) = _world_sum([mean], s.device)
    return total / s.dist.world_size


# --- the whole measurement -----------------------------------------------------------------------
def measure_plans(model, preset: str, graph: MMGraph, plans: dict[str, Plan], gpu: GPUSpec,
                  config: BenchConfig | None = None,
                  engines: dict[str, EngineConfig] | None = None,
                  ) -> tuple[list[PlanMeasurement], dict[str, Any]]:
    """Time every plan and user program on this machine's GPU (or CPU), interleaved (in groups
    with `config.plans_at_once`); see the module docstring. `engines` runs some labels on other
    gradient-sync settings than `config.engine` (an A/B of those settings in one run). Returns
    the measurements and the checks made (tolerances, compile)."""
    config = config or BenchConfig()
    engines = engines or {}
    variants = {label: _differences(config.engine, engine) for label, engine in engines.items()}
    plans, same = _distinct(plans, variants)
    progress = _Progress(time.perf_counter())
    checks: dict[str, Any] = {"phases": progress.phases}
    config = _without_unfitting_user_programs(graph, config, gpu, checks)
    groups = _plan_groups(list(plans), config.plans_at_once)
    if config.user_rounds == "alone" and config.user_programs:
        groups = [[], *groups]  # the user programs' own group
    results: list[PlanMeasurement] = []
    if len(groups) > 1:
        checks["plan_groups"] = groups
    reference: _Reference | None = None
    with handling_sigterm(_terminate):
        try:
            for i, labels in enumerate(groups):
                group_config = config if i == 0 else replace(config, user_programs=())
                if len(groups) > 1:
                    who = ", ".join(labels or group_config.user_programs)
                    progress.group = f"group {i + 1} of {len(groups)} ({who})"
                    _release_memory()
                measured, group_checks, reference = _measure_group(
                    model, preset, graph, {label: plans[label] for label in labels}, gpu,
                    group_config, engines, variants, progress, reference,
                    keep_reference=len(groups) > 1)
                results += measured
                _add_group_checks(checks, group_checks)
        except GradientsDiffer as refused:  # the groups measured before it are kept
            checks.setdefault("compile", progress.compile.to_dict())
            refused.measurements, refused.checks = results, {**checks,
                                                             "gradients": refused.checks}
            raise
        except _Terminated as stop:
            if stop.measured is not None:  # this group's timed rounds were done
                results += stop.measured[0]
                _add_group_checks(checks, stop.measured[1])
            checks.setdefault("compile", progress.compile.to_dict())
            raise BenchInterrupted(progress.last_phase, progress.elapsed_s(), results,
                                   checks) from None
    return _with_twins(results, same, plans), checks


def _without_unfitting_user_programs(graph: MMGraph, config: BenchConfig, gpu: GPUSpec,
                                     checks: dict[str, Any]) -> BenchConfig:
    """`config` less the user programs that cannot fit (`checks["user_programs_left_out"]`
    says why; the plans are still measured: where the user's program cannot run, mosaic's
    must). Each process counts the same, so every rank leaves out the same programs. An
    FSDP2 program on one process is refused here, before anything compiles."""
    world_size = launched_world_size()
    sharded = sorted(set(config.user_programs) & set(FSDP_USER_PROGRAMS))
    if sharded and world_size < 2:
        raise BenchError(f"user_programs {sharded} shard the training states over the GPUs, and "
                         "this bench runs one process; launch it on several GPUs (`torchrun "
                         "--standalone --nproc-per-node N -m mosaic bench MODEL --gpus N`) or "
                         "measure the DDP programs (torch-eager, torch-compile)")
    kept, left_out = user_programs_that_fit(graph, config.user_programs, world_size,
                                            gpu, config.engine.accumulation)
    for label, why in left_out.items():
        log.warning("bench: not measuring user program %r: it %s", label, why)
    if left_out:
        checks["user_programs_left_out"] = left_out
    return replace(config, user_programs=kept)


def _add_group_checks(checks: dict[str, Any], group_checks: dict[str, Any]) -> None:
    checks.setdefault("compile", group_checks["compile"])
    checks.setdefault("peak_memory_bytes", []).append(group_checks["peak_memory_bytes"])
    if "gradients" in group_checks:
        checks.setdefault("gradient_groups", []).append(group_checks["gradients"])
        checks.setdefault("gradients", group_checks["gradients"])  # the reference's group


def _plan_groups(labels: list[str], at_once: int | None) -> list[list[str]]:
    """The plan labels measured together: all at once, or in runs of `at_once`."""
    if not at_once or not labels:
        return [labels]
    return [labels[i:i + at_once] for i in range(0, len(labels), at_once)]


def _release_memory() -> None:
    """What the last group held (modules, CUDA graphs and their pools) goes back to the GPU."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _measure_group(model, preset: str, graph: MMGraph, plans: dict[str, Plan], gpu: GPUSpec,
                   config: BenchConfig, engines: dict[str, EngineConfig],
                   variants: dict[str, dict[str, Any]], progress: _Progress,
                   reference: _Reference | None = None, keep_reference: bool = False,
                   ) -> tuple[list[PlanMeasurement], dict[str, Any], _Reference | None]:
    """One set-up of `plans` (and the user programs of `config`), measured side by side and
    checked against `reference` (an earlier group's), else against this group's own, which it
    returns, its gradients on the host, when `keep_reference` (later groups will need it)."""
    s = _setup(model, preset, graph, plans, gpu, config, engines)
    progress.compile = s.compiled
    try:
        _peak_and_reset(s)
        progress.say(s, f"{len(s.contenders)} plan(s) set up")
        losses = _losses(s)
        if losses:  # a group of user programs alone has no plan to step yet
            _check_losses("eager", losses, reference)
            if reference is None and keep_reference:
                reference = _Reference(*next(iter(losses.items())))
        progress.say(s, f"one eager step each (compiles the modules: "
                        f"{s.compiled.to_dict()['total_compile_s']:.0f} s)")
        _capture(s, progress)
        _add_user_programs(s, config, model, preset)
        if reference is None and keep_reference and not losses:  # user programs alone
            reference = _Reference(*next(iter(_losses(s).items())))
        checks: dict[str, Any] = {"compile": s.compiled.to_dict()}
        errors: dict[str, dict[str, float]] = {}
        if config.check_gradients:
            errors, checks["gradients"] = _checked_gradients(s, graph.names, reference)
            progress.say(s, "gradients checked (user programs compiled)")
        _check_losses("after compile and CUDA-graph capture", _losses(s), reference)
        timings = _timed_rounds(s, config)
        peak = _peak_and_reset(s)
        checks["peak_memory_bytes"] = (None if peak is None else  # the fullest rank's
                                       int(_world_sum([float(peak)], s.device, "max")[0]))
        progress.say(s, f"{config.rounds} timed round(s) done")
        results = [PlanMeasurement(
            label=label, plan=plans.get(label),
            step_times_s=[step for step, _ in timings.steps[label]],
            launch_times_s=[launch for _, launch in timings.steps[label]],
            in_flight_step_times_s=timings.in_flight[label],
            pool=c.session.pool.describe() if c.session else {}, grad_error=errors.get(label, {}),
            startup_s=c.startup_s, engine_variant=variants.get(label) or None,
            graph_memory_bytes=c.graph_memory_bytes, graph_reserved_bytes=c.graph_reserved_bytes,
            graph_pool_bytes=c.graph_pool_bytes) for label, c in s.contenders.items()]
        try:
            _record_step_details(s, results, config)
        except _Terminated as stop:  # the timed rounds are measured: a time limit keeps them
            stop.measured = (results, checks)
            raise
        progress.say(s, "one traced step and GPU utilisation per plan recorded")
        return results, checks, reference
    except torch.OutOfMemoryError as exc:
        raise out_of_memory(progress, len(s.contenders), exc) from exc
    finally:
        _close(s.contenders)
        end_distributed(s.dist)


def _record_step_details(s: _Setup, results: list[PlanMeasurement], config: BenchConfig) -> None:
    """Each contender's module timeline, GPU utilisation and torch.profiler trace, taken after
    the timed rounds (each runs steps of its own)."""
    for m in results:
        c = s.contenders[m.label]
        m.timeline = _timeline(s, c)
        m.gpu_util = _nvml_util(s, c, config.nvml_seconds)
        m.torch_trace = _torch_trace(s, c, config.torch_trace_dir)


def _capture(s: _Setup, progress: _Progress) -> None:
    """Every plan's CUDA graphs, timed (start-up) and weighed (memory the capture kept)."""
    for label, c in s.contenders.items():
        start, before, pools = time.perf_counter(), _memory(s), _pool_bytes(s)
        c.session.capture_graphs()
        c.startup_s += time.perf_counter() - start
        if before is not None and c.session.runner.graphed:
            after = _memory(s)
            c.graph_memory_bytes = after[0] - before[0]
            c.graph_reserved_bytes = after[1] - before[1]
            c.graph_pool_bytes = _pool_bytes(s) - pools
        progress.say(s, f"{label}: " + ("CUDA graphs captured" if c.session.runner.graphed
                                         else "ready (eager: no CUDA graphs)"))


def _checked_gradients(s: _Setup, names: list[str], reference: _Reference | None,
                       ) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """`_check_gradients`, and the first group's reference gradients kept on the host for the
    later groups (when `reference` is being built)."""
    errors, checks, ref_grads = _check_gradients(s, names, reference)
    if reference is not None and reference.grad_label is None:
        reference.grad_label = checks["reference"]
        reference.grad_checks = {key: checks[key]
                                 for key in ("reference", "noise_floor", "tolerance",
                                             "tolerance_other_kernels", "reference_kernels")}
        reference.grads = ref_grads  # on the host already
    return errors, checks


def _memory(s: _Setup) -> tuple[int, int] | None:
    """(bytes the caching allocator hands out, bytes it holds from the GPU) on this rank's GPU;
    None on CPU. A captured graph's private pool stays reserved though its activations are
    freed between replays, so only the second counts them."""
    if s.device.type != "cuda":
        return None
    torch.cuda.synchronize(s.device)
    return torch.cuda.memory_allocated(s.device), torch.cuda.memory_reserved(s.device)


def _pool_bytes(s: _Setup) -> int | None:
    """Bytes this rank's allocator holds in private pools (CUDA graphs'); None on CPU."""
    if s.device.type != "cuda":
        return None
    index = s.device.index if s.device.index is not None else torch.cuda.current_device()
    return private_pool_bytes(torch.cuda.memory_snapshot(), index)


def private_pool_bytes(segments: list[dict[str, Any]], device: int) -> int:
    """The total size of the allocator segments on `device` that belong to a private pool
    (a CUDA graph's): pool id (0, 0) is the default pool (torch.cuda.memory_snapshot)."""
    return sum(seg["total_size"] for seg in segments if seg.get("device") == device
               and tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0))


def _peak_and_reset(s: _Setup) -> int | None:
    if s.device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(s.device)
    torch.cuda.reset_peak_memory_stats(s.device)
    return peak


def out_of_memory(progress: _Progress, contenders: int,
                  error: BaseException | None = None) -> BenchError:
    """What to do when the GPU ran out of memory measuring: every plan keeps its own CUDA
    graphs and their memory pool through the interleaved rounds (Unified-IO 2 `paper` with
    four plans ran out of the H200's 141 GB capturing the fourth). Measured alone, a plan
    that does not fit needs a smaller batch or accumulated micro-batches instead."""
    asked = ""
    if error is not None and (tried := re.search(r"Tried to allocate [\d.]+ [KMG]iB", str(error))):
        asked = f" (it t{tried[0][1:]})"
    if contenders > 1:
        fix = ("Measure them in groups (--plans-at-once 1: each plan set up, timed and "
               "released in turn), or fewer (--planners mosaic; --user-programs \"\"), or a "
               "smaller --batch")
    else:
        fix = ("It was measured alone already: a smaller --batch, or --accumulation N "
               "(micro-batches of batch/N)")
    return BenchError(
        f"out of GPU memory{asked} after {progress.last_phase!r}, with {contenders} plan(s) "
        "and user program(s) measured side by side: each plan keeps its CUDA graphs and their "
        f"memory for the interleaved rounds. {fix}")


@dataclass(slots=True)
class _Progress:
    """Where a long start-up spends its time (compiling eight `paper` modules twice takes
    minutes): one INFO line per phase, from rank 0, with the seconds since the bench began;
    the same (seconds, phase) pairs go into the results (`checks.phases`)."""

    start: float
    phases: list[dict[str, Any]] = field(default_factory=list)
    group: str = ""
    """The plan group being measured (`plans_at_once`), named in each of its phases."""
    compile: CompileReport = field(default_factory=CompileReport)
    """The compile report of the group being set up (what an interrupted run reports)."""

    @property
    def last_phase(self) -> str:
        return self.phases[-1]["phase"] if self.phases else "setting up"

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start

    def say(self, s: _Setup, what: str) -> None:
        elapsed = self.elapsed_s()
        what = f"{self.group}: {what}" if self.group else what
        self.phases.append({"s": round(elapsed, 2), "phase": what})
        if s.dist.rank == 0:
            log.info("bench %6.1f s: %s", elapsed, what)


def _differences(base: EngineConfig, engine: EngineConfig) -> dict[str, Any]:
    return {f: getattr(engine, f) for f in VARIANT_FIELDS if getattr(engine, f) != getattr(base, f)}


def _distinct(plans: dict[str, Plan], variants: dict[str, dict[str, Any]],
              ) -> tuple[dict[str, Plan], dict[str, tuple[str, Plan]]]:
    """The plans to measure, one per placement structure, and each other label's twin (the
    label measured for it) with its own plan. Planners often agree (DistMM, Spindle and
    Megatron on one GPU): measuring a plan twice costs time and graph memory, and showed a
    +-7% spread between identical plans that reads like a difference."""
    first: dict[tuple, str] = {}
    distinct: dict[str, Plan] = {}
    same: dict[str, tuple[str, Plan]] = {}
    for label, plan in plans.items():
        key = (plan_key(plan), tuple(sorted(variants.get(label, {}).items())))
        twin = first.setdefault(key, label)
        if twin == label:
            distinct[label] = plan
        else:
            same[label] = (twin, plan)
    return distinct, same


def _with_twins(results: list[PlanMeasurement], same: dict[str, tuple[str, Plan]],
                measured: dict[str, Plan]) -> list[PlanMeasurement]:
    """Every label in the order given: plans (twins right after the plan they share), then
    user programs."""
    by_label = {m.label: m for m in results}
    out: list[PlanMeasurement] = []
    for label in measured:
        out.append(by_label[label])
        out += [dataclasses.replace(by_label[label], label=twin_label, plan=plan,
                                    same_plan_as=label)
                for twin_label, (twin, plan) in same.items() if twin == label]
    return out + [m for m in results if m.label not in measured]


def environment(device_name: str | None = None) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "hardware": device_name or (torch.cuda.get_device_name(0) if cuda else "cpu"),
        "num_sms": torch.cuda.get_device_properties(0).multi_processor_count if cuda else None,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "transformers": package_versions(("transformers",))["transformers"],
        "git_sha": git_sha(),
    }


def _ratio(slower: float | None, faster: float | None) -> float | None:
    return slower / faster if slower and faster else None


def _in_flight_row(m: PlanMeasurement, in_flight: dict[str, float | None], flops: float,
                   peak_flops: float) -> dict[str, Any]:
    """A contender's in-flight step as MFU (of the datasheet peak) and as speedups over the
    others' in-flight steps; nothing where its steps were not run in flight."""
    mine = in_flight[m.label]
    if mine is None:
        return {}
    return {"mfu_in_flight": flops / (peak_flops * mine),
            "speedup_in_flight_vs": {b: in_flight[b] / mine for b in (*BASELINES, *USER_PROGRAMS)
                                     if in_flight.get(b)}}


def bench_report(graph: MMGraph, measurements: list[PlanMeasurement], gpu: GPUSpec,
                 preset: str, num_gpus: int) -> dict[str, Any]:
    """The results object of `mosaic bench`: per contender (plan or user program) the median
    and spread of its step times, prediction and error, MFU, speedups and gradient error."""
    medians = {m.label: m.median_s for m in measurements}
    in_flight = {m.label: m.summary()["in_flight_median_s"] for m in measurements}
    flops = graph.total_flops()
    rows = []
    for m in measurements:
        predicted = m.plan.predicted_iteration_s if m.plan else None
        row = {"planner": m.label, "measured_iteration_s": m.median_s, **m.summary(),
               "predicted_iteration_s": predicted,
               "samples_per_s": graph.global_batch / m.median_s,
               "mfu": flops / (num_gpus * gpu.datasheet_bf16_flops * m.median_s),
               "mfu_vs_measured_peak": flops / (num_gpus * gpu.peak_bf16_flops * m.median_s),
               "speedup_vs": {b: medians[b] / m.median_s
                              for b in (*BASELINES, *USER_PROGRAMS) if b in medians},
               "grad_error": m.grad_error,
               "predicted_memory_bytes": (max(gpu_memory_bytes(m.plan, graph).values())
                                          if m.plan else None),
               "plan": m.plan.to_dict() if m.plan else None}
        if predicted:
            row["prediction_error"] = predicted / m.median_s - 1
        row.update(_in_flight_row(m, in_flight, flops, num_gpus * gpu.datasheet_bf16_flops))
        rows.append(row)
    baselines = [medians[b] for b in BASELINES if b in medians]
    best = min(baselines) if baselines else None
    mosaic = medians.get("mosaic")
    return {
        "model": graph.name, "preset": preset, "global_batch": graph.global_batch,
        "graph": graph.to_dict(),  # the module facts the plans ran on (perf/results.graph_of)
        "gpus": num_gpus, **environment(),
        "model_tflop_per_iteration": flops / 1e12,
        "best_baseline_s": best,
        "mosaic_speedup_vs_best_baseline": best / mosaic if best and mosaic else None,
        "mosaic_speedup_vs_torch_compile": (medians["torch-compile"] / mosaic
                                            if mosaic and "torch-compile" in medians else None),
        "mosaic_speedup_vs_torch_compile_in_flight": _ratio(in_flight.get("torch-compile"),
                                                            in_flight.get("mosaic")),
        "results": rows,
    }
