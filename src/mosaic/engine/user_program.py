"""The user's own program: the baseline `mosaic bench` measures beside mosaic's plans.

What an ML engineer writes by hand without mosaic: every module in graph order in ONE
autograd graph, bf16 autocast on CUDA, optionally `torch.compile` per module, and
DistributedDataParallel over the whole world (every rank holds the whole model and its
contiguous slice of the global batch), or FSDP2 (below). The modules are the ones the plans train (shared
weights): they are neither copied nor changed here; compiled wrappers are separate objects.

Gradient scale (W = world size, N = global batch, n = N / W samples per rank). After `step`,
every parameter's `.grad` equals the gradient of the GLOBAL loss, the reference
`ZooModel.loss(modules, whole batch)`, on every rank, exactly (up to float rounding):
* per-sample-mean sinks (LLMs): rank r backpropagates its local mean l_r; DDP averages, so
  grad = (1/W) sum_r grad l_r = grad of the global mean (n is the same on every rank).
* contrastive heads (`needs_global_batch = True`): each rank all-gathers the head's inputs
  with a DIFFERENTIABLE all-gather (`gather_batch`: the math of torch.distributed.nn.functional
  .all_gather, open_clip's `gather_with_grad=True`), so every rank computes the same global
  loss L. Head parameters: each rank has the full dL/dtheta, DDP's average keeps it.
  Encoder parameters: the gather's backward sums every rank's dL/dx_r onto rank r (W copies
  of the same L), giving W * dL/dx_r there; DDP's average divides by W, so the encoders get
  exactly dL/dphi.
  (open_clip's other convention, a plain all-gather with the live local slice put back,
  would leave the encoders at 1/W of the true gradient; this one needs no correction.)
The loss `step` returns is this rank's share, l_r / W or L / W (equal split), so the SUM over
ranks is the global loss, as with PlanRunner.

DDP and shared modules: this DDP (not static_graph) ignores backward passes it did not start,
so the plans may train the same parameters before, between and after its steps.

FSDP2 (`shard_states=True`), what the same user writes when the replicas do not fit (torchtitan's
recipe): each module's layers, then each module, then the whole program are `fully_shard` units
over the world; the weights are gathered in bf16 for compute where autocast is on (FSDP2's
mixed precision) and the gradients reduce-scattered in fp32, summed and divided by W, which is
DDP's average above, so the gradient scale is the same. FSDP2 cannot shard a scalar (a
contrastive head's temperature): those stay whole and their gradients are averaged by hand after
backward. It shards its modules in place: give it modules no one else trains. Compiled, it runs
without CUDA graphs (FSDP2 gathers and frees each layer's weights outside the compiled code).
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule

from mosaic.engine.compile import MOSAIC_MODES, mode_options
from mosaic.engine.fsdp import gather_dtype, shard_program
from mosaic.errors import MosaicError
from mosaic.graph import MMGraph

log = logging.getLogger(__name__)

Batch = dict[str, tuple[Tensor, ...]]
"""Each module's own input tensors, by module name."""

CompileFn = Callable[[str, nn.Module, str], Callable[..., Any]]
"""(module name, module, mode) -> the callable that runs the module (a separate object)."""

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs",
                 "reduce-overhead-max-autotune-gemm")
"""torch's modes, and reduce-overhead with Inductor's GEMM tuning (engine/compile.py
MOSAIC_MODES: torch has no name for it, so it is passed as options)."""

_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune", "reduce-overhead-max-autotune-gemm")
"""Inductor modes with CUDA graphs (cudagraph trees): the first call compiles and warms up,
the second records, so two steps hold compile work; one step in the other modes."""


class UserProgramError(MosaicError):
    """A model or setting the user-program baseline cannot run; the message says the fix."""


def plain_compile(name: str, module: nn.Module, mode: str) -> Callable[..., Any]:
    """`torch.compile(module, mode=mode)`: what a user writes (no per-module workarounds);
    a mode torch has no name for is written as its options."""
    del name  # the engine's compile_fn uses it for workarounds and its report
    if mode in MOSAIC_MODES:
        return torch.compile(module, options=mode_options(mode))
    return torch.compile(module, mode=mode)


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when none is running."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_batch(x: Tensor) -> Tensor:
    """The global batch of `x`, sharded over the world in rank order, differentiably: the
    backward sums every rank's gradient of the whole batch and hands each rank its slice
    (what torch.distributed.nn.functional.all_gather does; that one is deprecated in 2.13)."""
    return _GatherBatch.apply(x)


class _GatherBatch(torch.autograd.Function):
    # List-based collectives: torch 2.13 deprecates the *_tensor forms for *_single ones
    # that torch 2.11 lacks.
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        world_size = dist.get_world_size()
        if dist.get_backend() == dist.Backend.NCCL:
            parts = list(grad.contiguous().chunk(world_size))
            mine = torch.empty_like(parts[0])
            dist.reduce_scatter(mine, parts)
            return mine
        # Gloo has no reduce-scatter: sum the whole batch's gradient (in place, on a copy:
        # autograd may hold `grad` elsewhere), keep this rank's slice.
        whole = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(whole)
        return whole.chunk(world_size)[dist.get_rank()]


class GraphProgram(nn.Module):
    """Every module of the graph in graph order, one autograd graph; forward returns the
    sink's loss over the batch this rank holds (heads needing the global batch gather it)."""

    def __init__(self, graph: MMGraph, modules: dict[str, nn.Module],
                 callables: dict[str, Callable[..., Any]], amp: bool, device_type: str) -> None:
        super().__init__()
        self.names = list(graph.names)
        self.predecessors = {m: graph.predecessors(m) for m in self.names}
        # Registered for parameters() and DDP; the callables (compiled views or the modules
        # themselves) stay out of the module tree, so no parameter is registered twice.
        self.graph_modules = nn.ModuleDict({m: modules[m] for m in self.names})
        self.callables = dict(callables)
        self.gather = {m for m in self.names if _needs_global_batch(modules[m])}
        self.amp, self.device_type = amp, device_type
        self.distributed = world()[1] > 1

    def forward(self, data: Batch) -> Tensor:
        outputs: dict[str, Tensor] = {}
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.amp):
            for m in self.names:
                upstream = [outputs[p] for p in self.predecessors[m]]
                if m in self.gather and self.distributed:
                    upstream = [gather_batch(x) for x in upstream]
                outputs[m] = self.callables[m](*data.get(m, ()), *upstream)
        return outputs[self.names[-1]]


def _needs_global_batch(module: nn.Module) -> bool:
    return bool(getattr(module, "needs_global_batch", False))


class UserProgram:
    """Modules in graph order in ONE autograd graph, bf16 autocast on CUDA, DDP (or FSDP2)
    over the world. `reduce_dtype=torch.bfloat16` sums the gradients in bf16, as the engine's
    `reduce_dtype='bf16'` does: DDP's `bf16_compress_hook` (NCCL only), FSDP2's reduce_dtype.

    `step(local_batch(batch))` runs forward and backward and leaves in every parameter's
    `.grad` the gradient of the global loss (see the module docstring); the optimizer, and
    zeroing the gradients, are the caller's.
    """

    def __init__(self, *, graph: MMGraph, modules: dict[str, nn.Module], compile_mode: str | None,
                 device: torch.device, amp: bool | None = None,
                 compile_fn: CompileFn | None = None, shard_states: bool = False,
                 reduce_dtype: torch.dtype = torch.float32, accumulation: int = 1,
                 shard_degree: int | None = None) -> None:
        """`shard_degree`: with `shard_states`, the processes one copy of the states spreads
        over (HSDP, `program_mesh`); None: a node's (`node_shard_degree`)."""
        self.graph, self.device = graph, torch.device(device)
        self.compile_mode = compile_mode
        self.rank, self.world_size = world()
        _check(graph, modules, compile_mode, self.world_size)
        _check_accumulation(graph, modules, accumulation, self.world_size)
        self.accumulation = accumulation
        if shard_states:
            _check_sharding(compile_mode, self.world_size)
            if shard_degree is None:
                shard_degree = node_shard_degree(self.world_size)
        cuda = self.device.type == "cuda"
        self.amp = cuda if amp is None else amp
        self.param_dtype = gather_dtype(self.amp) if shard_states else None
        """The dtype FSDP2 gathers the weights in for compute (None: as stored, fp32)."""
        self.program = GraphProgram(graph, modules, dict(modules), self.amp, self.device.type)
        self.model: nn.Module = self.program
        self.whole_params: list[nn.Parameter] = []
        """Scalars FSDP2 leaves whole: their gradients are averaged by hand after backward."""
        if shard_states:
            mesh = program_mesh(self.device.type, self.world_size, shard_degree)
            self.whole_params = shard_program(self.program, [modules[m] for m in graph.names],
                                              mesh, divide_by=self.world_size,
                                              param_dtype=self.param_dtype,
                                              reduce_dtype=reduce_dtype)
        elif self.world_size > 1:
            self.model = _wrap_ddp(self.program, self.device, reduce_dtype)
        if compile_mode is not None:
            compile_fn = compile_fn or plain_compile
            self.program.callables = {m: compile_fn(m, modules[m], compile_mode)
                                      for m in graph.names}
        self.compile_seconds = 0.0
        """Wall seconds spent compiling: the first steps' time beyond a compiled step's."""
        self._compile_steps = 0 if compile_mode is None else (
            2 if compile_mode in _CUDA_GRAPH_MODES else 1)
        self._first_steps_s: list[float] = []

    def parameters(self) -> list[nn.Parameter]:
        """Every module's parameters, graph order (what the caller's optimizer updates)."""
        return list(self.program.parameters())

    def local_batch(self, batch: Batch) -> Batch:
        """This rank's samples [r*N/W, (r+1)*N/W) of every module's own inputs, on the device
        (a module needing the global batch gets all N). Call before the timed region."""
        per_rank = self.graph.global_batch // self.world_size
        start, stop = self.rank * per_rank, (self.rank + 1) * per_rank
        out = {}
        for m, tensors in batch.items():
            if m not in self.program.graph_modules or not tensors:
                continue
            lo, hi = (0, self.graph.global_batch) if m in self.program.gather else (start, stop)
            out[m] = tuple(t[lo:hi].to(self.device, non_blocking=True) for t in tensors)
        return out

    def step(self, data: Batch) -> Tensor:
        """Forward and backward on `data` (from `local_batch`), as `accumulation` micro-steps
        (each loss scaled by 1/K, gradients synchronised on the last only, as the engine's
        `--accumulation K`); returns this rank's share of the global loss, detached: the sum
        over ranks is the global loss."""
        timed = len(self._first_steps_s) <= self._compile_steps
        start_s = self._now() if timed else 0.0
        k = self.accumulation
        if k == 1:
            share = self._micro_step(data, 1, sync=True)
        else:
            share = torch.zeros((), device=self.device)
            for i, part in enumerate(_micro_batches(data, k)):
                # Added at once: a CUDA-graph tree's next replay overwrites its loss output.
                share = share + self._micro_step(part, k, sync=i == k - 1)
        self._average_whole_grads()
        share = share / (k * self.world_size)
        if timed:
            self._first_steps_s.append(self._now() - start_s)
            self._account_compile()
        return share

    def _micro_step(self, data: Batch, scale: int, sync: bool) -> Tensor:
        """Forward and backward of the loss / `scale`, the gradients synchronised over the
        world only if `sync`; returns the unscaled loss, detached."""
        if self.compile_mode in _CUDA_GRAPH_MODES:
            # One training iteration per step for cudagraph trees (forward, then backward).
            torch.compiler.cudagraph_mark_step_begin()
        with self._gradient_sync(sync):
            loss = self.model(data)
            if not isinstance(loss, Tensor) or loss.dim() != 0:
                raise UserProgramError(
                    f"sink {self.graph.names[-1]!r} must return a scalar loss tensor, got "
                    f"{getattr(loss, 'shape', type(loss).__name__)}; reduce the loss to a scalar")
            (loss / scale if scale > 1 else loss).backward()
        return loss.detach().float()

    def _gradient_sync(self, sync: bool) -> AbstractContextManager[Any]:
        """DDP's `no_sync` on a micro-step that does not synchronise. FSDP2 reduce-scatters on
        every micro-step, as torchtitan does: skipping it would hold a whole unsharded
        gradient on every GPU until the last, the memory sharding saves."""
        if not sync and self.model is not self.program and not isinstance(self.model, FSDPModule):
            return self.model.no_sync()
        return nullcontext()

    def _average_whole_grads(self) -> None:
        grads = [p.grad for p in self.whole_params if p.grad is not None]
        if grads:
            flat = torch.stack([g.reshape(()) for g in grads])
            dist.all_reduce(flat)
            for g, total in zip(grads, flat.unbind(), strict=True):
                g.copy_(total / self.world_size)

    # --- compile time --------------------------------------------------------------------
    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _account_compile(self) -> None:
        """Sum of the first steps' seconds; once a compiled step has been timed, less that
        step's seconds for each of them (what those steps would have cost compiled)."""
        k, times = self._compile_steps, self._first_steps_s
        warm = sum(times[:k])
        if len(times) > k:
            warm -= k * times[k]
        self.compile_seconds = max(0.0, warm)


def _wrap_ddp(program: GraphProgram, device: torch.device,
              reduce_dtype: torch.dtype = torch.float32) -> nn.Module:
    """DDP over the WORLD around the whole program: buckets all-reduced (averaged) as the
    backward makes gradients ready, in bf16 with torch's `bf16_compress_hook` when
    `reduce_dtype` is bf16. Two departures from DDP's defaults, both because the
    modules are shared with the plans and must not be written here: no start-up broadcast of
    the weights (`init_sync=False`: they are identical on every rank by construction, a
    function of the seed and module name) and no per-step broadcast of buffers (the zoo's are
    constants: position ids, rotary frequencies; there are no running statistics)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    device_ids = None
    if device.type == "cuda":
        device_ids = [device.index if device.index is not None else torch.cuda.current_device()]
    # torch 2.13 renamed broadcast_buffers (deprecated) to forward_sync_buffers; 2.11 has only
    # the old name. init_sync=False also skips the start-up buffer broadcast in both.
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in parameters
                      else {"broadcast_buffers": False})
    ddp = DistributedDataParallel(program, device_ids=device_ids, init_sync=False,
                                  **no_buffer_sync)
    if reduce_dtype == torch.bfloat16 and dist.get_backend() == dist.Backend.NCCL:
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif reduce_dtype == torch.bfloat16:  # torch's hook refuses gloo: a CPU run is a smoke test
        log.warning("the user program's DDP reduces its gradients in fp32: torch's bf16 hook "
                    "needs NCCL, and this world runs %s", dist.get_backend())
    elif reduce_dtype != torch.float32:
        raise UserProgramError(f"reduce_dtype={reduce_dtype}; use torch.float32 or torch.bfloat16")
    return ddp


def _micro_batches(data: Batch, k: int) -> list[Batch]:
    """`data` cut into k micro-batches along the batch (views, no copies)."""
    chunks = {m: [t.chunk(k) for t in tensors] for m, tensors in data.items()}
    return [{m: tuple(c[i] for c in parts) for m, parts in chunks.items()} for i in range(k)]


def _check_accumulation(graph: MMGraph, modules: dict[str, nn.Module], accumulation: int,
                        world_size: int) -> None:
    if accumulation < 1:
        raise UserProgramError(f"accumulation={accumulation} must be >= 1 (1: none)")
    if accumulation == 1:
        return
    heads = [m for m in graph.names if _needs_global_batch(modules[m])]
    if heads:
        raise UserProgramError(f"modules {heads} need the whole batch in one step (a contrastive "
                               "loss), so the program cannot accumulate micro-batches; use "
                               "accumulation=1, as the engine does for them")
    per_rank = graph.global_batch // world_size
    if per_rank % accumulation:
        raise UserProgramError(f"{per_rank} samples per process do not split into "
                               f"accumulation={accumulation} equal micro-batches; use a global "
                               f"batch that is a multiple of {world_size * accumulation}")


def node_shard_degree(world_size: int) -> int:
    """torchtitan's hybrid sharding across nodes: a copy of the states a node, where the
    world spans several (LOCAL_WORLD_SIZE processes a node, as torchrun sets it); 0 (the
    whole world) inside one node."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return local if 1 < local < world_size and world_size % local == 0 else 0


def program_mesh(device_type: str, world_size: int, shard_degree: int) -> DeviceMesh:
    """The world as FSDP2's mesh: 1-D (every process shards the states), or with
    0 < `shard_degree` < the world, copies x `shard_degree` processes (HSDP: the copies'
    reduce-scattered gradients all-reduced), the ranks of a copy consecutive."""
    if not shard_degree or shard_degree == world_size:
        return DeviceMesh.from_group(dist.group.WORLD, device_type)
    if shard_degree < 2 or world_size % shard_degree:
        raise UserProgramError(f"shard_degree={shard_degree} must be >= 2 and divide the "
                               f"{world_size} processes; use a divisor, or 0 for all of them")
    return init_device_mesh(device_type, (world_size // shard_degree, shard_degree),
                            mesh_dim_names=("replicate", "shard"))


def _check_sharding(compile_mode: str | None, world_size: int) -> None:
    if world_size < 2:
        raise UserProgramError("shard_states=True shards the training states over the world, "
                               "which is one process; launch several (`torchrun "
                               "--nproc-per-node N`) or use the DDP program (shard_states=False)")
    if compile_mode in _CUDA_GRAPH_MODES:
        raise UserProgramError(
            f"compile_mode={compile_mode!r} captures CUDA graphs, which the FSDP2 program does "
            "not use: FSDP2 gathers and frees each layer's weights around it, outside the "
            "compiled code. Use compile_mode='default' (torchtitan's choice) or None (eager)")


def _check(graph: MMGraph, modules: dict[str, nn.Module], compile_mode: str | None,
           world_size: int) -> None:
    names = graph.names
    missing = [m for m in names if m not in modules]
    if missing:
        raise UserProgramError(f"modules {missing} of graph {graph.name!r} are not built; the "
                               "user program holds the whole model: pass every module")
    if compile_mode is not None and compile_mode not in COMPILE_MODES:
        raise UserProgramError(f"compile_mode={compile_mode!r}; use None (eager) or one of "
                               f"{COMPILE_MODES}")
    dotted = [m for m in names if "." in m]
    if dotted:
        raise UserProgramError(f"module names {dotted} contain '.', which nn.ModuleDict "
                               "refuses; rename the modules")
    for i, m in enumerate(names):
        late = [p for p in graph.predecessors(m) if names.index(p) >= i]
        if late:
            raise UserProgramError(f"module {m!r} is listed before its inputs {late}; list the "
                                   "graph's modules in topological order")
    if graph.sinks != [names[-1]]:
        raise UserProgramError(f"graph {graph.name!r} has sinks {graph.sinks}; the user program "
                               f"needs exactly one, listed last (the loss)")
    heads = [m for m in names[:-1] if _needs_global_batch(modules[m])]
    if heads:
        raise UserProgramError(f"modules {heads} need the global batch but feed others; only "
                               "the sink (the loss) may set needs_global_batch")
    if graph.global_batch % world_size:
        raise UserProgramError(f"global batch {graph.global_batch} does not split evenly over "
                               f"{world_size} processes; use a global batch that is a multiple "
                               f"of {world_size}")
