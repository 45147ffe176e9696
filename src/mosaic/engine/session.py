"""One rank's compiled view of one plan: its modules' views, SM partition pool, process groups
and runner. The training loop (`trainer.py`) and the plan measurement (`mosaic.measure`) both
build their ranks through here, so a plan trains exactly as it is measured.

    d = start_distributed(None)
    modules = build_modules(model, preset, local_modules(plan, d.rank), seed, d.device)
    views, report = compile_modules(modules, config.compile)
    session = RankSession.create(plan, graph, modules, d, gpu, config, views=views)
    loss = session.step(session.load_local_batch(batch_loader(model, preset, n, seed, step)))
"""

from __future__ import annotations

import gc
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mosaic.engine import tensor_parallel
from mosaic.engine.comm import PlanComm, check_world_size
from mosaic.engine.compile import COMPILE_MODES, COMPILE_SCOPES, traced_anew
from mosaic.engine.green import SMPartitionPool, StreamRequest, requests_for_plan
from mosaic.engine.main_weights import MainWeightsAdamW, MicroStepGradients
from mosaic.engine.runner import GRAD_SYNC, REDUCE_DTYPES, PlanRunner, RunnerConfig, StepOutput
from mosaic.engine.update_gates import UpdateGates
from mosaic.errors import MosaicError
from mosaic.graph import MMGraph
from mosaic.hardware import GPUSpec
from mosaic.plan import Plan

OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


class SessionError(MosaicError):
    """A rank that cannot be set up for the plan; the message names the setting and the fix."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """How the engine runs any plan (the plan says what runs where, this says how)."""

    graphs: bool = False
    """Per-module CUDA graphs, captured on each module's own stream (GPU only)."""
    compile: str | None = None
    """Inductor per module before capture: 'default', 'max-autotune-no-cudagraphs' or None."""
    compile_scope: str = "module"
    """What one torch.compile call covers: each whole module, or each repeated block of it
    ('blocks': compile time no longer grows with depth; engine/compile.py)."""
    amp: bool | None = None
    """bf16 autocast; None: on for CUDA, off on CPU."""
    grad_sync: str = "flat"
    """'flat' (one gradient buffer per module, one all-reduce after its backward: fastest
    measured), 'overlapped' (that buffer all-reduced bucket by bucket during the backward,
    inside its CUDA graph: engine/bucket_reduce.py; predicted to hide most of the sum, not yet
    measured on GPUs: `mosaic bench --engine-variant grad_sync=overlapped`), 'ddp'
    (DistributedDataParallel per module) or 'bucketed' (concatenated all-reduce after backward;
    kept to measure against)."""
    reduce_dtype: str = "fp32"
    """Gradient all-reduce precision: 'fp32' or 'bf16'."""
    bucket_view: bool = False
    """With 'ddp': gradients are views into DDP's buckets (no copy back after the all-reduce).
    Off until measured on the GPU (`mosaic bench --engine-variant bucket_view=true`)."""
    optimizer_overlap: bool = False
    """One optimizer per module, each stepped on the module's stream (a side stream for a
    temporal stage's) as soon as its gradients are final (OverlappedOptimizer), not one after
    every backward. `mosaic bench` only, until measured on the GPU
    (`--engine-variant optimizer_overlap=true`)."""
    bf16_weights: bool = False
    """Weights of the GEMMs stored in bf16, fp32 main weights in the optimizer, which writes
    the bf16 weights as it updates (engine/main_weights.py): no autocast weight casts.
    Measured on one H200 at 1.04-1.21x (`mosaic bench --engine-variant bf16_weights=true`).
    Not sharded or tensor-parallel plans; data-parallel modules need reduce_dtype='bf16'
    (their bf16 gradients are summed in bf16); accumulated micro-steps add their gradients
    in fp32 (main_weights.MicroStepGradients)."""
    bf16_flat_grads: bool = True
    """With bf16_weights on one GPU, graphed: each module's gradients copied into one flat
    buffer, updated in one launch; False: updated a weight at a time where they lie, no copy
    (`--engine-variant bf16_weights=true,bf16_flat_grads=false` measures the two)."""
    bf16_moments: bool = False
    """With bf16_weights: the bf16 weights' AdamW moments kept in bf16, stored by stochastic
    rounding (engine/main_weights.py): the update moves 20 bytes a parameter instead of 28 and
    the states hold 12 instead of 16, as Megatron's precision-aware optimizer with bf16
    moments does."""
    fp32_main_weights: bool = True
    """With bf16_weights: an fp32 main copy of each bf16 weight in the optimizer; False: none,
    the update writes each new weight to bf16 by stochastic rounding (engine/rounded_weights.py):
    6 bytes a parameter less moved by the update (20 -> 14 with bf16 moments), 4 less held."""
    update_under_forward: bool = False
    """With bf16_weights: the optimizer step runs on a side stream under the next step's
    forward, in forward order, each module and each block of a module compiled by blocks
    waiting only for its own weights (engine/update_gates.py). `mosaic bench` only
    (`--engine-variant update_under_forward=true`): 1.007-1.019x on Unified-IO 2 `paper` b4
    on one H200, where the overlapped update and GEMMs slow each other down."""
    update_sms: int = 0
    """With update_under_forward: the update stream's SMs, a green context of that many (a
    multiple of the GPU's SM granularity), so the forward's GEMMs keep the rest; 0: a plain
    stream, all SMs. Measured slower on Unified-IO 2 `paper` b4 (48 SMs: 71.6 ms against 63.5
    on a plain stream): the update's kernels need more than 48 SMs beside the forward."""
    update_group: int = 1
    """With bf16 weights updated a weight at a time and no fp32 main weights: same-shaped
    weights updated this many at a time in one compiled launch (engine/grouped_update.py;
    Inductor's combo kernels); 1: a launch a weight. Measured slower on the H200 (Unified-IO 2
    `paper` b4, 2026-12-05: the LLM's update 15.90 ms grouped by 8 against 13.97, the step
    62.57 against 61.04 ms), so it stays a bench variant without a `mosaic train` flag."""
    fp8_first_moment: bool = False
    """With bf16 weights and moments updated a weight at a time without main weights: AdamW's
    first moment in float8 e4m3 with a scale per 256 elements, the second in bf16
    (engine/fp8_first_moment.py): 12 bytes a parameter moved instead of 14, but in three
    kernels (the block scales need a reduction first) at 1.49 TB/s against one at 3.62:
    Unified-IO 2 `paper` b4 stepped 78.62 ms against 61.04 on the H200 (2026-12-05), so it
    stays a bench variant (`--engine-variant ...,fp8_first_moment=true`)."""
    grads_in_graph: bool = True
    """With graphs: each backward graph accumulates its module's parameter gradients itself
    (no per-parameter host work; engine/graphed.py), except where DDP synchronises them."""
    accumulation: int = 1
    """Micro-steps per optimizer step (gradient accumulation): each runs global_batch / this."""
    timeline: bool = False

    def __post_init__(self) -> None:
        if self.compile is not None and self.compile not in COMPILE_MODES:
            raise SessionError(f"compile={self.compile!r}; use one of {COMPILE_MODES} or None")
        if self.compile_scope not in COMPILE_SCOPES:
            raise SessionError(f"compile_scope={self.compile_scope!r}; use one of {COMPILE_SCOPES}")
        if self.grad_sync not in GRAD_SYNC:
            raise SessionError(f"grad_sync={self.grad_sync!r}; use one of {GRAD_SYNC}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise SessionError(f"reduce_dtype={self.reduce_dtype!r}; use one of {sorted(REDUCE_DTYPES)}")
        if self.accumulation < 1:
            raise SessionError(f"accumulation={self.accumulation} must be >= 1")
        if not self.bf16_flat_grads and not self.bf16_weights:
            raise SessionError("bf16_flat_grads=False changes only bf16 weights' gradients: "
                               "set bf16_weights=True too, or leave bf16_flat_grads on")
        if self.update_under_forward:
            self._check_update_under_forward()
        elif self.update_sms:
            raise SessionError(f"update_sms={self.update_sms} sizes the update stream of "
                               "update_under_forward: set that too, or leave update_sms 0")
        if self.bf16_moments and not self.bf16_weights:
            raise SessionError("bf16_moments keeps the bf16 weights' AdamW moments in bf16: set "
                               "bf16_weights=True too (--bf16-weights), or leave it off")
        if not self.fp32_main_weights and not self.bf16_weights:
            raise SessionError("fp32_main_weights=False drops the bf16 weights' fp32 copies: set "
                               "bf16_weights=True too (--bf16-weights), or leave it on")
        if self.update_group != 1:
            self._check_update_group()
        if self.fp8_first_moment:
            self._check_fp8_first_moment()

    def _check_update_group(self) -> None:
        if self.update_group < 1:
            raise SessionError(f"update_group={self.update_group} must be >= 1 (1: a launch a "
                               "weight)")
        if not self.bf16_weights or self.fp32_main_weights or self.bf16_flat_grads:
            raise SessionError(f"update_group={self.update_group} groups the launches of the "
                               "update a weight at a time without main weights: set "
                               "bf16_weights=True, bf16_flat_grads=False and "
                               "fp32_main_weights=False too, or leave update_group 1")

    def _check_fp8_first_moment(self) -> None:
        if (not self.bf16_weights or not self.bf16_moments or self.fp32_main_weights
                or self.bf16_flat_grads):
            raise SessionError("fp8_first_moment keeps the first moment of the update a weight "
                               "at a time without main weights in 8 bits: set "
                               "bf16_weights=True, bf16_moments=True, bf16_flat_grads=False "
                               "and fp32_main_weights=False too, or leave it off")
        if self.update_group != 1:
            raise SessionError("fp8_first_moment and update_group > 1 are separate updates: "
                               "choose one")

    def _check_update_under_forward(self) -> None:
        if not self.bf16_weights:
            raise SessionError("update_under_forward gates the bf16 weights' update block by "
                               "block: set bf16_weights=True too (fp32 weights are updated by "
                               "one fused AdamW, nothing to gate)")
        if self.accumulation > 1:
            raise SessionError(f"update_under_forward with accumulation={self.accumulation}: "
                               "accumulated gradients are zeroed between steps, while the "
                               "update may still read them; use accumulation=1")
        if self.update_sms < 0:
            raise SessionError(f"update_sms={self.update_sms} must be >= 0 (0: all SMs)")
        if self.optimizer_overlap:
            raise SessionError("update_under_forward and optimizer_overlap schedule the same "
                               "update two ways: choose one")
        if not self.fp32_main_weights:
            raise SessionError("update_under_forward gates the update of fp32 main weights: "
                               "leave fp32_main_weights on with it, or drop update_under_forward")

    @property
    def moments(self) -> str:
        """The bf16 weights' moments for MainWeightsAdamW: 'bf16' or 'fp32'."""
        return "bf16" if self.bf16_moments else "fp32"

    def holding(self, graph: MMGraph) -> MMGraph:
        """`graph` as this engine holds its modules (weights', moments' dtypes, the bf16
        update's layout): what the memory model then counts."""
        return graph.with_precision(bf16_weights=self.bf16_weights,
                                    bf16_moments=self.bf16_moments,
                                    bf16_flat_grads=self.bf16_flat_grads,
                                    fp32_main_weights=self.fp32_main_weights)

    def runner_config(self) -> RunnerConfig:
        """bf16 weights turn bf16 autocast on where amp is unset (on the CPU too): they need it,
        and `mosaic train --bf16-weights` has no other way to ask for it there."""
        amp = True if self.amp is None and self.bf16_weights else self.amp
        return RunnerConfig(graphs=self.graphs, amp=amp, timeline=self.timeline,
                            grad_sync=self.grad_sync, reduce_dtype=self.reduce_dtype,
                            bucket_view=self.bucket_view, grads_in_graph=self.grads_in_graph,
                            accumulates=self.accumulation > 1,
                            bf16_flat_grads=self.bf16_flat_grads)


# --- the process and what it builds ----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Dist:
    rank: int
    world_size: int
    device: torch.device
    owns_group: bool
    host_group: Any = None
    """A gloo group beside an NCCL world, for the few floats the host reduces each step (step
    time, peak memory): over NCCL they would queue behind the GPU's next step and wait for it."""


def end_distributed(d: Dist) -> None:
    """Destroy the world this process started, and collect what still holds its groups.

    A process group whose last reference dies at interpreter exit is destroyed after CUDA
    has torn its context down, and NCCL's destructor then aborts the process ("context is
    destroyed") although every step succeeded. So pending work is finished first and
    unreachable objects holding groups are collected while CUDA still runs."""
    if d.owns_group and dist.is_initialized():
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)
        dist.destroy_process_group()
        _HOST_GROUP.clear()
    gc.collect()


def launched_world_size() -> int:
    """Processes in the world: the running process group's, else torchrun's WORLD_SIZE (1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def start_distributed(device: str | None, timeout_s: float | None = None) -> Dist:
    """Join torchrun's world (env://) or run as a one-process world. `timeout_s` bounds every
    collective: a rank that died or hangs makes the others fail after it, not wait forever
    (gloo raises; NCCL's watchdog aborts the process). None: torch's default (10 min)."""
    cuda = torch.cuda.is_available() and device != "cpu"
    if device == "cuda" and not cuda:
        raise SessionError("device='cuda' but no CUDA device is visible; leave device unset")
    running = dist.is_available() and dist.is_initialized()
    world = launched_world_size()
    rank = dist.get_rank() if running else int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise SessionError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs "
                               "are visible; use --nproc-per-node <= the GPU count")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    owns = False
    if world > 1 and not running:
        if timeout_s is not None and not timeout_s > 0:
            raise SessionError(f"timeout_s={timeout_s} must be > 0 seconds (--timeout-s)")
        _init_group("nccl" if cuda else "gloo", device if cuda else None, timeout_s)
        owns = True
    return Dist(rank=rank, world_size=world, device=device, owns_group=owns,
                host_group=_host_group(world, cuda, timeout_s))


_HOST_GROUP: list[Any] = []
"""The world's gloo group for host floats, made once per world (`mosaic train` starts the
world and `train()` joins it: one group, not two); dropped when the world ends."""


def _host_group(world: int, cuda: bool, timeout_s: float | None) -> Any:
    if world == 1 or not cuda:
        return None  # one process, or a gloo world already
    if not _HOST_GROUP:
        timeout = {"timeout": timedelta(seconds=timeout_s)} if timeout_s is not None else {}
        _HOST_GROUP.append(dist.new_group(backend="gloo", **timeout))
    return _HOST_GROUP[0]


def host_all_reduce(values: list[float], op: str, group: Any = None) -> list[float]:
    """Host floats reduced over the world ('sum' or 'max') without touching a GPU stream:
    `group` is the NCCL world's gloo group (Dist.host_group); None in a gloo world."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return t.tolist()


def _init_group(backend: str, device: torch.device | None, timeout_s: float | None) -> None:
    """init_process_group over env:// with the store's keys under this attempt's prefix.
    Why: torchrun's workers share the agent's store across restarts (--max-restarts), so
    without it a restarted rank can read the dead attempt's gloo addresses and fail with
    'connectFullMesh failed ... Connection refused' (seen in 1 of 3 restarts on 2 cores)."""
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    store, rank, world = next(dist.rendezvous("env://", **({"timeout": timeout} if timeout else {})))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"mosaic/attempt-{attempt}", store)
    kwargs = {"timeout": timeout} if timeout else {}
    if device is not None:
        kwargs["device_id"] = device
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kwargs)


def local_modules(plans: Plan | list[Plan], rank: int) -> list[str]:
    """Modules any of `plans` places on `rank`, sorted."""
    plans = [plans] if isinstance(plans, Plan) else plans
    return sorted({p.module for plan in plans for s in plan.stages for p in s.placements
                   if rank in p.gpus})


def build_modules(model: Any, preset: str, names: list[str], seed: int,
                  device: torch.device | str = "cpu") -> dict[str, nn.Module]:
    """Modules `names`, weights a function of (seed, name, device type) only (zoo contract)."""
    return model.build_modules(preset, torch.device(device), torch.float32, names=names, seed=seed)


def make_batch(model: Any, preset: str, global_batch: int, seed: int,
               step: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """The global batch of `step` on the host, identical on every rank."""
    if hasattr(model, "make_rows"):  # the same samples a rank loads for its share
        return model.make_rows(preset, None, step=step, seed=seed, global_batch=global_batch)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return model.make_inputs(preset, global_batch, generator, torch.device("cpu"))


Rows = dict[str, tuple[torch.Tensor, ...]]
RowLoader = Callable[[Mapping[str, tuple[int, int]]], Rows]
"""{module: (start, stop)} of the step's global batch -> those rows of each module's inputs."""


def batch_loader(model: Any, preset: str, global_batch: int, seed: int, step: int,
                 device: Any = None) -> RowLoader:
    """Loads rows of step `step`. A model with `make_rows` (the zoo, `mosaic.data` sources)
    makes only the rows asked for; any other model makes the whole global batch once (its
    `make_inputs`), which is then sliced. `device`: draw there, where the model can
    (`draws_on_device`: the zoo's synthetic rows); None or another model: on the host."""
    if hasattr(model, "make_rows"):
        where = {"device": device} if device is not None and draws_on_device(model) else {}
        return lambda ranges: model.make_rows(preset, ranges, step=step, seed=seed,
                                              global_batch=global_batch, **where)
    from mosaic.data import slice_rows

    batch = make_batch(model, preset, global_batch, seed, step)
    return lambda ranges: slice_rows(batch, ranges)


def draws_on_device(model: Any) -> bool:
    """Whether `model.make_rows` takes a `device` to draw its rows on."""
    return bool(getattr(model, "draws_on_device", False))


def make_optimizer(name: str, params: list[nn.Parameter], lr: float,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """Fused where torch has it: AdamW always, SGD over plain tensors (torch 2.13 has no
    DTensor rule for the fused SGD). On CUDA the default multi-tensor AdamW measured about
    100 bytes of memory traffic per parameter on the H200 (10 ms a step for qwen3-vl small),
    fused about 28. And a fused optimizer skips a step's update on the device when told
    `found_inf`, so the trainer need not wait for the GPU to check a step (engine/steps.py),
    sharded (DTensor) states too (tests/test_sharding_engine.py)."""
    from torch.distributed.tensor import DTensor

    plain = not any(isinstance(p, DTensor) for p in params)
    if name == "adamw" and plain and any(p.requires_grad for p in params):
        # The same fused AdamW, captured as one CUDA graph once the gradients stay put
        # (main_weights.py; without bf16 weights it keeps no main copies): eager, its launch
        # over a graphed CLIP `small` step's fp32 norms and biases alone cost the host 1.6 of
        # the step's 11.7 ms under cProfile on the H200.
        return MainWeightsAdamW(params, lr, weight_decay=weight_decay)
    kwargs = {"lr": lr, "weight_decay": weight_decay}
    if params and (name == "adamw" or plain):
        kwargs["fused"] = True
    return OPTIMIZERS[name](_param_groups(params), **kwargs)


class OverlappedOptimizer:
    """One optimizer per module of `session`, each stepped as soon as the module's gradients
    are final (StepOutput.grads_ready): on the module's own stream, or, for a module that ran
    on the caller's stream (a temporal stage), on a side stream, so that its update runs under
    the backward of the modules after it; the modules whose gradients are summed after the
    join step on the caller's stream. The caller's stream then waits for all of them, so the
    next step sees the new weights.

    Why: the optimizer step is memory-bound (AdamW reads and writes 28 bytes a parameter,
    fp32 or bf16 weights alike) and one step after every backward runs alone on the GPU: 24.7 ms of
    Unified-IO 2 `paper`'s 74 ms with bf16 weights on the H200, nearly all of it the LLM's,
    whose backward ends before the encoders' starts."""

    def __init__(self, session: RankSession,
                 make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
        """`make` builds one module's optimizer from its trainable parameters (fused AdamW,
        or MainWeightsAdamW over a module's bf16 weights)."""
        self.session = session
        self.optimizers = {m: make(params) for m, module in session.runner.modules.items()
                           if (params := [p for p in module.parameters() if p.requires_grad])}
        self._side: torch.cuda.Stream | None = None

    def step(self) -> None:
        ready = self.session.last_output.grads_ready if self.session.last_output else {}
        caller = torch.cuda.current_stream() if ready else None
        finished = []
        # In the order the gradients became final: one side stream runs its updates in turn,
        # and the first module's must not queue behind the last one's backward.
        order = [m for m in ready if m in self.optimizers]
        order += [m for m in self.optimizers if m not in ready]
        for m in order:
            optimizer = self.optimizers[m]
            if m not in ready:
                optimizer.step()
                continue
            stream, event = ready[m]
            if stream == caller:
                stream = self._side_stream()
            with torch.cuda.stream(stream):
                stream.wait_event(event)
                optimizer.step()
                finished.append(torch.cuda.Event())
                finished[-1].record(stream)
        for event in finished:
            caller.wait_event(event)

    def _side_stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream()
        return self._side

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=set_to_none)


def _param_groups(params: list[nn.Parameter]) -> list[dict[str, Any]]:
    """Sharded (DTensor) and plain parameters in separate groups: the fused and multi-tensor
    kernels batch a group's tensors by device and dtype, and refuse a batch that mixes
    DTensors with plain tensors (found on two H200s: FSDP leaves scalar parameters whole)."""
    from torch.distributed.tensor import DTensor

    sharded = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return [{"params": group} for group in (plain, sharded) if group]


UPDATE_STREAM = "mosaic.update"
"""The pool key of the update's green-context stream (EngineConfig.update_sms)."""


# --- the session -----------------------------------------------------------------------------
class RankSession:
    """Everything this rank needs to run steps of one plan."""

    def __init__(self, *, plan: Plan, graph: MMGraph, runner: PlanRunner, comm: PlanComm,
                 pool: SMPartitionPool, config: EngineConfig) -> None:
        self.plan, self.graph, self.runner, self.comm = plan, graph, runner, comm
        self.pool, self.config = pool, config
        self.gates = runner.gates
        """The update stream and events when the update runs under the forward, else None."""
        self.last_output: StepOutput | None = None
        self._folded: MicroStepGradients | None = None
        """bf16 weights' micro-step gradients summed in fp32 (made at the first step)."""

    @classmethod
    def create(cls, plan: Plan, graph: MMGraph, modules: dict[str, nn.Module], d: Dist,
               gpu: GPUSpec, config: EngineConfig,
               views: dict[str, nn.Module] | None = None) -> RankSession:
        check_world_size(plan, d.world_size)
        step_graph = _micro_step_graph(plan, graph, modules, config.accumulation)
        comm = PlanComm.create(plan, d.device)
        views = _shard_tensor_parallel(plan, modules, comm, views)
        requests = requests_for_plan(plan, d.rank, gpu)
        if config.update_sms:  # a group of its own: it overlaps every stage
            requests.append(StreamRequest(key=UPDATE_STREAM, mode="cap", num_sms=config.update_sms,
                                          group=len(plan.stages)))
        pool = SMPartitionPool.create(requests, d.device.index if d.device.type == "cuda" else None,
                                      gpu)
        gates = None
        if config.update_under_forward:
            order = [p.module for stage in plan.stages for p in stage.placements
                     if d.rank in p.gpus and p.module in modules]  # else the runner says
            stream = pool.stream(UPDATE_STREAM) if config.update_sms else None
            gates = UpdateGates(order, {m: modules[m] for m in order}, d.device, stream)
        try:
            runner = PlanRunner(plan=plan, graph=step_graph, modules=modules, comm=comm, pool=pool,
                                config=config.runner_config(), device=d.device, views=views,
                                gates=gates)
        except BaseException:
            pool.close()
            raise
        return cls(plan=plan, graph=graph, runner=runner, comm=comm, pool=pool, config=config)

    @property
    def modules(self) -> dict[str, nn.Module]:
        return self.runner.modules

    def _micro_step_gradients(self) -> MicroStepGradients:
        if self._folded is None:
            self._folded = MicroStepGradients(self.parameters())
        return self._folded

    def parameters(self) -> list[nn.Parameter]:
        return self.runner.parameters()

    def gradients(self, module: str) -> list[torch.Tensor]:
        """The module's gradients on this rank after a step (PlanRunner.gradients)."""
        return self.runner.gradients(module)

    def local_batch(self, batch: dict[str, tuple[torch.Tensor, ...]]) -> list[dict[str, Any]]:
        """This rank's samples of each micro-step, on the device (copies: call untimed)."""
        n = self.config.accumulation
        chunks = [{m: tuple(t.chunk(n)[k] for t in ts) for m, ts in batch.items()}
                  for k in range(n)]
        return [self.runner.local_batch(chunk) for chunk in chunks]

    def sample_ranges(self) -> list[dict[str, tuple[int, int]]]:
        """Per micro-step, the rows of the step's global batch that each module of this rank
        processes: micro-step k runs rows [k * M, (k + 1) * M) (M = global batch /
        accumulation), of which this rank's share, as `local_batch` slices them."""
        per_micro = self.runner.graph.global_batch
        ranges = self.runner.sample_ranges()
        return [{m: (k * per_micro + start, k * per_micro + stop)
                 for m, (start, stop) in ranges.items()}
                for k in range(self.config.accumulation)]

    def load_local_batch(self, load: RowLoader) -> list[dict[str, Any]]:
        """This rank's samples of each micro-step, on the device, loading only the rows it
        processes (`local_batch` takes the whole global batch instead). Call untimed."""
        return self.to_device(self.local_rows(load))

    def local_rows(self, load: RowLoader) -> list[dict[str, Any]]:
        """This rank's samples of each micro-step, where `load` makes them: on the host it
        touches no CUDA state, so a background thread may run it while the GPU step (or a
        graph capture) goes on; a loader drawing on the GPU is the training thread's."""
        return [{m: ts for m, ts in load(ranges).items() if m in ranges}
                for ranges in self.sample_ranges()]

    def to_device(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        device = self.runner.device
        return [{m: tuple(t.to(device, non_blocking=True) for t in ts) for m, ts in r.items()}
                for r in rows]

    def step(self, data: list[dict[str, Any]]) -> StepOutput:
        """Forward and backward of every micro-step, gradients synchronised once; the loss is
        this rank's share of the step's loss (summed over micro-steps)."""
        n = len(data)
        self.runner.attach_grads()
        outs = []
        for k, d in enumerate(data):
            outs.append(self.runner.step(d, fraction=1.0 / n, sync=k == n - 1))
            if n > 1 and self.config.bf16_weights:
                self._micro_step_gradients().fold(k, n)
        last = outs[-1]
        if n > 1:
            last.loss = torch.stack([o.loss for o in outs]).sum()
        self.last_output = last  # where an OverlappedOptimizer finds the gradients' readiness
        return last

    def capture_graphs(self) -> None:
        self.runner.capture_graphs()

    def describe(self) -> dict[str, Any]:
        return {"pool": self.pool.describe(), "grad_sync": self.config.grad_sync,
                "grads_in_graph": self.config.grads_in_graph,
                "reduce_dtype": self.config.reduce_dtype, "accumulation": self.config.accumulation,
                "graphs": self.runner.graphed, "compile": self.config.compile,
                "bf16_weights": self.config.bf16_weights,
                "bf16_flat_grads": self.config.bf16_flat_grads,
                "bf16_moments": self.config.bf16_moments,
                "fp32_main_weights": self.config.fp32_main_weights,
                "update_group": self.config.update_group,
                "fp8_first_moment": self.config.fp8_first_moment,
                "sharded": sorted(self.runner.sharded)}  # this rank's FSDP2 modules

    def close(self) -> None:
        # DDP reducers hold the module groups' communicators: let them go now, while the
        # process group still exists, not whenever the garbage collector gets to them
        # after destroy_process_group.
        self.runner.release_ddp()
        self.comm.close()
        self.pool.close()


def _shard_tensor_parallel(plan: Plan, modules: dict[str, nn.Module], comm: PlanComm,
                           views: dict[str, nn.Module] | None) -> dict[str, nn.Module] | None:
    """Shard this rank's tensor-parallel modules in place over their TP group's mesh
    (engine/tensor_parallel.py); their compiled views are traced anew over the DTensor
    weights (tests/test_tensor_parallel_dist.py trains them compiled by blocks)."""
    sharded = set()
    for name, module in modules.items():
        placement = plan.placement(name)
        if placement.tensor_parallel == 1 or comm.rank not in placement.gpus:
            continue
        group = next(g for g in placement.tp_groups if comm.rank in g)
        tensor_parallel.parallelize(name, module,
                                    tensor_parallel.mesh_of(comm.group(group), comm.device))
        sharded.add(name)
    return None if views is None else traced_anew(views, sharded)


def _micro_step_graph(plan: Plan, graph: MMGraph, modules: dict[str, nn.Module],
                      accumulation: int) -> MMGraph:
    """The graph one micro-step runs: the global batch split `accumulation` ways."""
    if accumulation == 1:
        return graph
    if any(getattr(m, "needs_global_batch", False) for m in modules.values()):
        raise SessionError(f"accumulation={accumulation}: a contrastive head needs the whole "
                           "batch in one step, so it cannot be split; use accumulation=1")
    per_step, rest = divmod(graph.global_batch, accumulation)
    widest = max(p.dp_degree for s in plan.stages for p in s.placements)
    if rest or per_step % widest:
        raise SessionError(f"accumulation={accumulation} must divide global_batch "
                           f"{graph.global_batch} into micro-steps divisible by the widest DP "
                           f"degree {widest}; pick a divisor of {graph.global_batch // widest}")
    return replace(graph, global_batch=per_step)


# --- fault injection: a hook for the reliability tests only ------------------------------------
FAULT_ENV = "MOSAIC_FAULT"
FAULT_ACTIONS = ("kill", "term", "hang", "nan")
FAULT_PHASES = ("step", "checkpoint")


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """A fault injected through the MOSAIC_FAULT environment variable, to test that a run
    survives it (tests/test_faults.py, RELIABILITY.md); never set it in a real run.

        kill:rank=1:step=5                    rank 1 SIGKILLs itself as step 5 starts
        term:rank=1:step=4                    rank 1 is sent SIGTERM as step 4 starts (as a
                                              scheduler's preemption notice would)
        hang:rank=1:step=3                    rank 1 sleeps forever as step 3 starts
        nan:rank=0:step=2                     NaN in rank 0's first module's gradient at step 2
        kill:rank=0:step=6:during=checkpoint  after writing its shard of checkpoint 6, before
                                              the checkpoint is published
    It fires on attempt `attempt` only (torchrun's TORCHELASTIC_RESTART_COUNT; default 0), so
    the restarted run gets past it. Unset, it costs nothing."""

    action: str
    rank: int
    step: int
    during: str = "step"
    attempt: int = 0

    @classmethod
    def from_env(cls) -> Fault | None:
        spec = os.environ.get(FAULT_ENV, "")
        return cls.parse(spec) if spec else None

    @classmethod
    def parse(cls, spec: str) -> Fault:
        action, *fields = spec.split(":")
        fix = (f"{FAULT_ENV}={spec!r}: write ACTION:rank=R:step=S[:during=PHASE][:attempt=N] "
               f"with ACTION in {FAULT_ACTIONS}, PHASE in {FAULT_PHASES}, or unset it")
        try:
            values = dict(field.split("=", 1) for field in fields)
            fault = cls(action=action, rank=int(values.pop("rank")), step=int(values.pop("step")),
                        during=values.pop("during", "step"), attempt=int(values.pop("attempt", 0)))
        except (KeyError, ValueError):
            raise SessionError(fix) from None
        if values or action not in FAULT_ACTIONS or fault.during not in FAULT_PHASES:
            raise SessionError(fix)
        return fault

    def due(self, rank: int, step: int, during: str = "step") -> bool:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return (rank, step, during, attempt) == (self.rank, self.step, self.during, self.attempt)

    def fire(self) -> None:
        """kill, term and hang; `nan` is the trainer's to apply (it needs the gradients)."""
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        while self.action == "hang":
            time.sleep(3600)
