"""Run one training step of a plan on this rank (= GPU id).

Forward runs stage by stage in plan order, backward in reverse stage order. Each module runs
on its own autograd segment: its predecessors' outputs arrive as detached leaf tensors (from
`PlanComm.forward`), so a module's backward is an explicit call whose input gradients are
sent back along the same routes. Inside a stage, the modules this rank holds run concurrently
on their pool streams (temporal stages: one after another on the main stream).

Streams (GPU). The main stream M (current at construction) does the data movement, the
exchanges, the all-reduces and the optimizer. A module's stream waits for an event M records
once the module's inputs (or output gradient) are ready; M waits for a module's done event
before sending its output or all-reducing its gradients. Cross-stream tensors are all kept
alive until the step ends and M joins every module stream then, so the caching allocator can
never hand a block to one stream while another still reads it (no record_stream needed).

Losses. A per-sample-mean sink (the default) is scaled by local_batch / global_batch so that
the SUM all-reduce of gradients gives the gradient of the global mean. A head with
`needs_global_batch = True` (contrastive) sees the whole batch: see `_forward_module`.

Tensor parallelism (engine/tensor_parallel.py). A TP module was sharded by the session before
the runner was made; every GPU of its TP group runs the replica's samples and the same loss
(reported once: its share / t), its gradients are summed over the GPUs holding the same shard
by hand (not DDP), and it is compiled (its view traced anew after the split) but never
CUDA-graphed: its forward and backward hold TP collectives on the process group, which a
replayed graph would have to capture.

Sharded states (engine/fsdp.py). A placement with `shard` is sharded here with FSDP2 on its
process group, before the optimizer is built (it must see the DTensor shards). FSDP's
all-gathers and reduce-scatters run in its own forward / backward hooks, so such a module
gets no DDP and no hand all-reduce and is never CUDA-graphed. Its compiled view is traced
anew after sharding (compile.CompiledModule.traced_anew), as torchtitan compiles after
`fully_shard`: compiled by blocks, each layer unit's forward is one compiled graph and
FSDP's hooks run between them, outside the compiled code. Under autocast its weights are
gathered in bf16 (fsdp.gather_dtype). It reduce-scatters on every micro-step of an
accumulated step (`_no_sync`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mosaic.engine.bucket_reduce import InBackwardReduce
from mosaic.engine.comm import (
    FlatGrads,
    Key,
    PlanComm,
    routes_for,
    sample_range,
    stream_waits_for_sum,
)
from mosaic.engine.compile import blockwise_view, repeated_block_lists, traced_anew
from mosaic.engine.ddp import wrap_ddp
from mosaic.engine.fsdp import gather_dtype, hybrid_mesh, shard_module
from mosaic.engine.gate_slot import slotted
from mosaic.engine.graphed import InGraphGradModule, fresh_cublas_workspaces
from mosaic.engine.tensor_parallel import local_tensor
from mosaic.engine.timer import Mark, Timer
from mosaic.engine.update_gates import UpdateGates
from mosaic.errors import MosaicError
from mosaic.graph import MMGraph
from mosaic.plan import Placement, Plan


class EngineError(MosaicError):
    """A plan, model or setting the runner cannot execute; the message says the fix."""


GRAD_SYNC = ("ddp", "bucketed", "flat", "overlapped")
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True, slots=True)
class RunnerConfig:
    graphs: bool = False
    """Replay each module's forward and backward as CUDA graphs (GPU only) after one eager step."""
    amp: bool | None = None
    """bf16 autocast; None: on for CUDA, off on CPU (True: on there too)."""
    timeline: bool = False
    """Record start/end of every module's forward and backward (for the Gantt chart)."""
    grad_sync: str = "flat"
    """How a data-parallel module's gradients are summed: 'flat' (gradients live in one buffer
    per module, all-reduced whole after its stage's backward; comm.FlatGrads; the fastest
    measured, docs/engine.md), 'ddp' (DistributedDataParallel on the module's process group,
    buckets all-reduced as gradients are ready), 'overlapped' (the flat buffer all-reduced
    bucket by bucket during the module's backward, inside its backward CUDA graph when
    graphed; bucket_reduce.py; not yet measured on two GPUs) or 'bucketed' (flat 100 MB
    all-reduces after the module's backward; kept to measure against)."""
    reduce_dtype: str = "fp32"
    """'bf16' all-reduces gradients in bf16 (half the bytes; as Megatron and FSDP offer)."""
    bucket_view: bool = False
    """With 'ddp': gradients are views into DDP's buckets (ddp.py says why)."""
    grads_in_graph: bool = True
    """With graphs: a module's backward graph leaves its parameter gradients where they are
    read (graphed.py), with no per-parameter host work. Not for modules DDP synchronises
    (grad_sync='ddp' on several GPUs): DDP hooks each AccumulateGrad."""
    accumulates: bool = False
    """Several backwards per optimizer step (gradient accumulation): graphs add, not copy."""
    bf16_flat_grads: bool = True
    """bf16 weights on one GPU: the backward graph copies each module's gradients into one
    flat buffer so the optimizer updates the module in one launch (see gradient_home)."""

    def __post_init__(self) -> None:
        if self.grad_sync not in GRAD_SYNC:
            raise EngineError(f"grad_sync={self.grad_sync!r}; use one of {GRAD_SYNC}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise EngineError(f"reduce_dtype={self.reduce_dtype!r}; use one of {sorted(REDUCE_DTYPES)}")
        if self.reduce_dtype != "fp32" and self.grad_sync == "bucketed":
            raise EngineError("reduce_dtype='bf16' needs grad_sync='flat' or 'ddp'")


@dataclass(frozen=True, slots=True)
class GradientHome:
    """Where one module's parameter gradients live and who writes them (decided once)."""

    flat: bool
    """Views of one flat buffer (comm.FlatGrads)."""
    flat_sync: bool
    """Summed over the module's data-parallel group by one all-reduce of that buffer."""
    graph_mode: str | None
    """graphed.py's mode when the backward graph leaves them itself; None: autograd's
    AccumulateGrad does (eager modules, DDP's, or grads_in_graph off)."""
    reduce_in_backward: bool = False
    """The flat all-reduce runs bucket by bucket during the module's backward
    (grad_sync='overlapped'; bucket_reduce.py): inside the backward graph ("copy"), or from
    AccumulateGrad's hooks (eager). Not where backwards accumulate: the sum waits for the last."""


def gradient_home(config: RunnerConfig, *, plain: bool, data_parallel: bool,
                  accumulating: bool, bf16_weights: bool = False,
                  backward_alone: bool = True) -> GradientHome:
    """`plain`: neither tensor-parallel nor FSDP-sharded (so graphed, and summable as one
    buffer); `accumulating`: several backwards per optimizer step; `bf16_weights`: the
    module holds bf16 weights, whose optimizer updates them in one launch where their
    gradients lie end to end (main_weights.py): the graph copies them into the flat buffer
    (2 + 2 bytes a weight). Measured on one H200 that pays on Qwen3-VL `small` (update 6.31
    -> 3.65 ms, copies +0.92) but not clearly on Unified-IO 2 `paper`, whose 3.7 B parameters
    sit in large weights (copies +4.1 ms a step): config.bf16_flat_grads=False keeps each
    gradient where the backward left it, and the optimizer goes a weight at a time.
    `backward_alone`: no other module's backward runs beside this one's on its GPUs (a plan
    property, the same on every rank), which summing inside the backward needs: two
    modules' captured sums replayed side by side on one communicator would run in an order
    no rank controls."""
    flat_sync = plain and data_parallel and config.grad_sync in ("flat", "overlapped")
    synced_by_ddp = data_parallel and config.grad_sync == "ddp"  # DDP hooks AccumulateGrad
    in_graph = plain and config.graphs and config.grads_in_graph and not synced_by_ddp
    flat = flat_sync or (in_graph and (accumulating or (bf16_weights and config.bf16_flat_grads)))
    mode = None if not in_graph else "add" if accumulating else "copy" if flat else "own"
    in_backward = (flat_sync and config.grad_sync == "overlapped" and not accumulating
                   and backward_alone)
    return GradientHome(flat=flat, flat_sync=flat_sync, graph_mode=mode,
                        reduce_in_backward=in_backward)


def _shard_pieces(tensor: torch.Tensor) -> int:
    """Into how many distinct pieces a DTensor is split over its mesh (1: a plain tensor, or
    replicated on every mesh dimension)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return 1
    mesh = tensor.device_mesh
    return math.prod(mesh.size(dim) for dim, placement in enumerate(tensor.placements)
                     if placement.is_shard())


@dataclass(slots=True)
class StepOutput:
    loss: torch.Tensor
    """This rank's share of the global loss (summing it over ranks gives the loss), detached."""
    start: Mark
    marks: list[tuple[str, int, str, Mark, Mark]] = field(default_factory=list)
    """(module, stage, phase, start, end) per module and phase when timeline is on."""
    grads_ready: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    """module -> (stream, event) after which its parameter gradients are final for this step:
    on CUDA, at the last micro-step, for modules whose gradients nothing sums or reshards, so
    their optimizer step may start there while other modules are still in backward."""


@dataclass(slots=True)
class _StepState:
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    inputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    shares: list[torch.Tensor] = field(default_factory=list)
    done: dict[str, Any] = field(default_factory=dict)
    keep: list[torch.Tensor] = field(default_factory=list)
    micro: int = 0
    """Micro-batch index (selects the module's graphed callable for this micro-batch)."""
    fraction: float = 1.0
    """This micro-batch's share of the batch: the loss is scaled by it (gradient accumulation)."""
    sync: bool = True
    """All-reduce gradients at the end of this backward (False: accumulate locally)."""


def _gated_views(views: dict[str, nn.Module], modules: dict[str, nn.Module],
                 sharded: set[str]) -> dict[str, nn.Module]:
    """What runs for each module when the update is gated: a module run as itself (no
    compiled view) behind a view whose blocks wait in GateSlots; a compiled view by blocks
    holds its slots already (compile.py), one compiled whole waits per module only."""
    gated = dict(views)
    for m, module in modules.items():
        if m in sharded or views.get(m, module) is not module:
            continue
        lists = repeated_block_lists(module)
        if lists:
            gated[m] = blockwise_view(module, lists, slotted)
    return gated


class _Autocast(nn.Module):
    """The module under bf16 autocast (on CPU too when asked: amp=True); graphed as a whole,
    so eager and graphs run one code. The autocast cache must be off for CUDA-graph capture."""

    def __init__(self, inner: nn.Module, enabled: bool, device_type: str = "cuda") -> None:
        super().__init__()
        self.inner = inner
        self.enabled = enabled
        self.device_type = device_type

    def forward(self, *args: torch.Tensor) -> Any:
        if not self.enabled:
            return self.inner(*args)
        with torch.autocast(self.device_type, dtype=torch.bfloat16, cache_enabled=False):
            return self.inner(*args)


class PlanRunner:
    """Executes training steps of `plan` for the modules this rank holds."""

    def __init__(self, *, plan: Plan, graph: MMGraph, modules: dict[str, nn.Module],
                 comm: PlanComm, pool: Any = None, config: RunnerConfig | None = None,
                 device: torch.device | str = "cpu",
                 views: dict[str, nn.Module] | None = None,
                 gates: UpdateGates | None = None) -> None:
        """`views`: what runs for each module (e.g. its compiled view); default the module.
        `gates`: the optimizer's update runs under the forward (update_gates.py): each
        module's forward waits for its own update, each block for its own."""
        self.plan, self.graph, self.comm = plan, graph, comm
        self.config = config or RunnerConfig()
        self.device = torch.device(device)
        self.rank = comm.rank
        self.cuda = self.device.type == "cuda"
        if self.config.graphs and not self.cuda:
            raise EngineError("graphs=True needs a CUDA device; use graphs=False (eager) on CPU")
        self.stage_modules = [[p.module for p in s.placements if self.rank in p.gpus]
                              for s in plan.stages]
        self.local = [m for ms in self.stage_modules for m in ms]
        missing = [m for m in self.local if m not in modules]
        if missing:
            raise EngineError(f"modules {missing} are placed on rank {self.rank} but not built; "
                              "pass every module the plan places on this GPU")
        self.modules = {m: modules[m] for m in self.local}
        self.global_batch = {m: bool(getattr(modules[m], "needs_global_batch", False))
                             for m in self.local}
        for m, needs in self.global_batch.items():
            if needs and graph.successors(m):
                raise EngineError(f"module {m!r} needs the global batch but feeds "
                                  f"{graph.successors(m)}; only a sink (the loss) may need it")
        self.tensor_parallel = {m: plan.placement(m).tensor_parallel for m in self.local}
        for m, t in self.tensor_parallel.items():
            if t > 1 and self.global_batch[m]:
                raise EngineError(f"module {m!r} needs the global batch (contrastive loss) and "
                                  f"is placed with tensor_parallel={t}; use tensor_parallel=1")
        amp = self.cuda if self.config.amp is None else self.config.amp
        self.amp = amp
        """Whether the modules run under bf16 autocast (evaluation runs them so too)."""
        self.sharded = self._shard_modules()
        """Modules whose states FSDP2 shards: see "Sharded states" in the module doc."""
        views = traced_anew(views or {}, self.sharded)
        self.micro_batches = plan.micro_batches
        self._check_micro_batches()
        self._homes = {m: gradient_home(
            self.config, plain=self.tensor_parallel[m] == 1 and m not in self.sharded,
            data_parallel=len(self._grad_group(m)) > 1,
            accumulating=self.micro_batches > 1 or self.config.accumulates,
            bf16_weights=any(p.dtype == torch.bfloat16 for p in self.modules[m].parameters()),
            backward_alone=plan.stages[plan.stage_of(m)].runs_alone(m))
            for m in self.local}
        # One callable per micro-batch: a graphed callable's forward and backward must
        # alternate, and micro-batch k+1's forward runs before k's backward. Distinct wrapper
        # objects: make_graphed_callables replaces an nn.Module's forward in place.
        self.gates = gates
        views = _gated_views(views, self.modules, self.sharded) if gates else views
        self._callables: dict[str, list[Any]] = {
            m: [_Autocast(views.get(m, self.modules[m]), amp, self.device.type)
                for _ in range(self.micro_batches)]
            for m in self.local}
        self._ddp: dict[str, nn.Module] = {}
        self._flat: dict[str, FlatGrads] = {}
        """Each module's flat gradient buffer, where its home has one."""
        self._in_graph: dict[str, list[InGraphGradModule]] = {}
        """Modules whose backward graphs leave the gradients (one per micro-batch)."""
        self._param_lists: dict[str, list[nn.Parameter]] = {}
        self._in_backward: dict[str, InBackwardReduce] = {}
        """Modules whose flat buffer is summed during their backward (grad_sync='overlapped')."""
        self._reducing: list[Any] = []
        """Their all-reduces in flight, waited for at the end of the step."""
        self._ddp_pending = self.config.grad_sync == "ddp"
        """DDP is wrapped after the first synchronised step (after CUDA-graph capture when
        graphs are on), which shows the parameters a module leaves unused (DDP must ignore
        them); the steps before all-reduce by hand."""
        self._main = torch.cuda.current_stream(self.device) if self.cuda else None
        self._stage_streams = self._pipeline_streams()
        self._streams = {m: self._stream_for(m, pool) for m in self.local}
        routes = routes_for(plan, graph)
        self._routes_into = [[r for r in routes if plan.stage_of(r.dst) == t]
                             for t in range(len(plan.stages))]
        self.timer = Timer(self.device)
        self._samples: dict[str, tuple[torch.Tensor, ...]] | None = None
        self.graphed = False
        self.record_timeline = self.config.timeline
        """Switchable per step: a benchmark records one step's timeline after timing the rest."""

    # --- set-up helpers ------------------------------------------------------------------
    def _shard_modules(self) -> set[str]:
        """FSDP2 over the process group of each sharded placement on this rank, before any
        optimizer sees the parameters (they become DTensor shards)."""
        sharded = set()
        self._whole_params: dict[str, list[nn.Parameter]] = {}
        """Per sharded module, the parameters FSDP leaves whole (scalars): all-reduced by hand."""
        for m in self.local:
            placement = self.plan.placement(m)
            if not placement.shard:
                continue
            self._whole_params[m] = shard_module(
                self.modules[m], self._shard_mesh(placement), self.device,
                divide_by=self._divide_by(m), param_dtype=gather_dtype(self.amp),
                reduce_dtype=REDUCE_DTYPES[self.config.reduce_dtype])
            sharded.add(m)
        return sharded

    def _shard_mesh(self, placement: Placement) -> Any:
        """Where a sharded placement's states spread: its process group (plain FSDP), or
        with `shard_degree` the 2-D mesh of copies x the GPUs of one copy (HSDP)."""
        copies = placement.shard_groups
        if len(copies) == 1:
            return self.comm.group(placement.gpus)
        rank = self.comm.rank
        own = next(g for g in copies if rank in g)
        replicas = next(g for g in placement.replica_groups if rank in g)
        return hybrid_mesh(self.comm.group(replicas), self.comm.group(own), copies, self.device)

    def _check_micro_batches(self) -> None:
        if self.micro_batches == 1:
            return
        if self.comm.world_size != 1:
            raise EngineError(f"micro_batches={self.micro_batches} runs on one GPU (world size 1), "
                              f"not {self.comm.world_size}; use micro_batches=1")
        heads = [m for m, needs in self.global_batch.items() if needs]
        if heads:
            raise EngineError(f"micro_batches={self.micro_batches}: {heads} need the whole batch "
                              "(contrastive loss), so the batch cannot be split; use 1")

    def _wrap_ddp(self) -> dict[str, nn.Module]:
        """DDP per data-parallel module on its own process group (micro-batch overlap runs on
        one GPU only, so a module has one callable here). Call after a step: parameters
        without a gradient then are unused, and DDP is told to ignore them."""
        wrapped = {}
        for m in self.local:
            placement = self.plan.placement(m)
            group = self.comm.group(placement.gpus)
            if group is None or self.tensor_parallel[m] > 1 or m in self.sharded:
                continue  # DDP takes no DTensor parameters (TP shards, FSDP shards)
            callable_ = self._callables[m][0]
            unused = [n for n, p in callable_.named_parameters() if p.grad is None]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(callable_, unused)
            wrapped[m] = wrap_ddp(callable_, group, self.device, divide_by=self._divide_by(m),
                                  reduce_dtype=REDUCE_DTYPES[self.config.reduce_dtype],
                                  bucket_view=self.config.bucket_view)
        return wrapped

    def release_ddp(self) -> None:
        """Drop the DDP wrappers (and their reducers); a later step would wrap anew."""
        self._ddp.clear()
        self._ddp_pending = self.config.grad_sync == "ddp"

    def _pipeline_streams(self) -> dict[int, Any]:
        """The temporal stages off the main stream, on streams made now (at start-up). For
        micro-batch overlap, one a stage, the last stage's at high priority since it is the
        critical path the earlier stages fill around. Under a gated update (update_gates.py),
        all at high priority, above the update's stream: traced on the H200 with both at the
        default priority, the update's pointwise kernels took every SM and the forward's
        kernels ran between them, not beside them (Unified-IO 2 `paper` b4: kernel time / busy
        time 1.03); the block scheduler serves a higher-priority stream's blocks first, and
        with it they ran beside each other (1.19)."""
        if not self.cuda or (self.micro_batches == 1 and self.gates is None):
            return {}
        last = len(self.plan.stages) - 1
        high = min(torch.cuda.Stream.priority_range())
        return {t: torch.cuda.Stream(self.device, priority=high if self.gates or t == last else 0)
                for t, stage in enumerate(self.plan.stages) if stage.sharing == "temporal"}

    def _stream_for(self, module: str, pool: Any) -> Any:
        if not self.cuda:
            return None
        placement = self.plan.placement(module)
        stage = self.plan.stage_of(module)
        if stage in self._stage_streams:
            return self._stage_streams[stage]
        if self.plan.stages[stage].sharing == "temporal":
            return self._main
        if pool is not None:
            return pool.stream(module)
        high = min(torch.cuda.Stream.priority_range())  # lower number = more urgent
        return torch.cuda.Stream(self.device, priority=high if placement.priority else 0)

    def parameters(self) -> list[nn.Parameter]:
        """Parameters of the modules on this rank (what this rank's optimizer updates)."""
        return [p for m in self.local for p in self.modules[m].parameters()]

    def gradients(self, m: str) -> list[torch.Tensor]:
        """Module m's gradients after a step, in as few tensors as hold them all (for a check
        of every element, or scaling every one in place): its flat buffers where the gradients are known
        to be their views (its backward graph, or the flat all-reduce's repair, put them
        there), else each parameter's (a TP or FSDP shard's local part). Walking the
        module's tree for its parameters every step was the largest host cost of a graphed
        CLIP `small` step under cProfile on the H200 (3.9 of 11.7 ms): the list is kept."""
        if m not in self.local:
            return []
        if self._grads_in_flat_buffers(m):
            return list(self._flat[m].buffers.values())
        return [local_tensor(p.grad) for p in self._params_of(m) if p.grad is not None]

    def gradient_copies(self, m: str) -> list[int]:
        """Per tensor of `gradients(m)`, how many ranks of m's placement hold the same values:
        its data-parallel replicas, and for a DTensor (an FSDP or tensor-parallel shard) the
        ranks holding that shard. Summing over ranks each tensor's squared norm over its
        copies counts every gradient element once (gradient clipping's global norm)."""
        if m not in self.local:
            return []
        ranks = len(self.plan.placement(m).gpus)
        if self._grads_in_flat_buffers(m):
            return [ranks] * len(self._flat[m].buffers)
        return [ranks // _shard_pieces(p.grad) for p in self._params_of(m) if p.grad is not None]

    def _grads_in_flat_buffers(self, m: str) -> bool:
        return m in self._flat and (m in self._in_graph or self._homes[m].flat_sync)

    def _params_of(self, m: str) -> list[nn.Parameter]:
        if m not in self._param_lists:
            self._param_lists[m] = list(self.modules[m].parameters())
        return self._param_lists[m]

    def local_batch(self, batch: dict[str, tuple[torch.Tensor, ...]]) -> dict[str, tuple[torch.Tensor, ...]]:
        """This rank's samples of each local module's own inputs, on the device.
        Call before the timed region: it copies host data."""
        out = {}
        for m in self.local:
            if m not in batch:
                continue
            start, stop = self._sample_range(m)
            out[m] = tuple(t[start:stop].to(self.device, non_blocking=True) for t in batch[m])
        return out

    def sample_ranges(self) -> dict[str, tuple[int, int]]:
        """[start, stop) of the batch that each local module processes on this rank: the
        rows a per-rank data source loads (`RankSession.load_local_batch`)."""
        return {m: self._sample_range(m) for m in self.local}

    def _sample_range(self, module: str) -> tuple[int, int]:
        if self.global_batch[module]:
            return 0, self.graph.global_batch
        placement = self.plan.placement(module)
        return sample_range(self.graph.global_batch, placement.gpus, self.rank,
                            placement.tensor_parallel)

    def _grad_group(self, module: str) -> tuple[int, ...]:
        """GPUs this rank sums the module's gradients with: its placement's, or with TP those
        holding the same shard."""
        placement = self.plan.placement(module)
        if placement.tensor_parallel == 1:
            return placement.gpus
        return next(g for g in placement.dp_groups if self.rank in g)

    # --- one step ------------------------------------------------------------------------
    def step(self, data: dict[str, tuple[torch.Tensor, ...]], *, fraction: float = 1.0,
             sync: bool = True) -> StepOutput:
        """Forward and backward of every local module, gradients all-reduced. `data` comes
        from `local_batch`. The optimizer step is the caller's (on the same stream).
        Gradient accumulation: call once per micro-step with `fraction` = its share of the
        step's samples (the loss is scaled by it) and `sync=False` on all but the last
        (gradients accumulate locally and are all-reduced once)."""
        if self.micro_batches > 1:
            return self._pipelined_step(data, fraction)
        if not sync and self.graphed and any(h.reduce_in_backward for h in self._homes.values()):
            raise EngineError("step(sync=False) on graphs that sum their gradients inside the "
                              "backward (grad_sync='overlapped'): set RunnerConfig.accumulates "
                              "for gradient accumulation")
        st = _StepState(fraction=fraction, sync=sync)
        out = StepOutput(loss=torch.zeros((), device=self.device), start=self.timer.mark(self._main))
        with self._on(self._main), self._no_sync(sync):
            for t in range(len(self.plan.stages)):
                self._forward_stage(t, data, st, out)
            for t in reversed(range(len(self.plan.stages))):
                self._backward_stage(t, st, out)
            self._main_waits(st, set(st.done))  # join: see "Streams" in the module doc
            for work in self._reducing:  # the main stream (the optimizer's) waits for the sums
                work.wait()
            self._reducing.clear()
            if st.shares:
                out.loss = torch.stack([s.float() for s in st.shares]).sum()
        # After capture when graphs are on: CUDA-graph capture of the module's backward failed
        # on the H200 once DDP wrapped it ("operation would make the legacy stream depend on a
        # capturing blocking stream"); a DDP made after capture drives the graphed module fine.
        if self._ddp_pending and sync and (self.graphed or not self.config.graphs):
            self._ddp, self._ddp_pending = self._wrap_ddp(), False
        return out

    def _pipelined_step(self, data: dict[str, tuple[torch.Tensor, ...]],
                        fraction: float) -> StepOutput:
        """Micro-batches with the last stage of k overlapping the earlier stages of k+1:
        E_f(0) | E_f(1) + L(0) | E_b(0) + L(1) | E_b(1) ... in enqueue order. The main stream
        waits only for the micro-batch it hands over, so the other one's work runs on."""
        n, last = self.micro_batches, len(self.plan.stages) - 1
        chunks = [{m: tuple(x.chunk(n)[k] for x in xs) for m, xs in data.items()} for k in range(n)]
        sts = [_StepState(micro=k, fraction=fraction / n) for k in range(n)]
        out = StepOutput(loss=torch.zeros((), device=self.device), start=self.timer.mark(self._main))
        with self._on(self._main):
            for t in range(last):
                self._forward_stage(t, chunks[0], sts[0], out)
            for k in range(n):
                if k + 1 < n:
                    for t in range(last):
                        self._forward_stage(t, chunks[k + 1], sts[k + 1], out)
                self._forward_stage(last, chunks[k], sts[k], out)
                for t in reversed(range(last + 1)):
                    self._backward_stage(t, sts[k], out, join=False)
            for st in sts:
                self._main_waits(st, set(st.done))
            shares = [s.float() for st in sts for s in st.shares]
            if shares:
                out.loss = torch.stack(shares).sum()
        return out

    def _forward_stage(self, t: int, data: dict, st: _StepState, out: StepOutput) -> None:
        routes = self._routes_into[t]
        self._main_waits(st, {r.src for r in routes})
        for key, x in self.comm.forward(routes, st.outputs).items():
            st.inputs[key] = x.detach().requires_grad_(x.is_floating_point())
        ready = self._record(self._main)
        for m in self.stage_modules[t]:
            stream = self._streams[m]
            with self._on(stream):
                self._wait(stream, ready)
                start = self._mark(stream)
                if self.gates is not None:
                    self.gates.wait_module(m, stream)
                with self._gates_active():
                    self._forward_module(m, data.get(m, ()), st)
                st.done[m] = self._record(stream)
                self._add_mark(out, m, t, "fwd", start, stream)

    def _forward_module(self, m: str, own: tuple[torch.Tensor, ...], st: _StepState) -> None:
        """Run module m. Contrastive heads (`needs_global_batch`) all-gather their inputs over
        their DP group, the local slice being the live tensor (open_clip's trick), so every
        replica computes the same global loss L. Gradient scaling, exact for any DP degree b:
        - inputs: replica j's live slice receives dL/dx_j exactly (other slices are
          constants in its graph), so encoder gradients need no scaling and sum over
          encoder replicas to the true gradient;
        - head parameters: every replica computes the full dL/dtheta (theta touches all N
          samples in its own graph), so the SUM all-reduce is divided by b (an average);
        - the reported loss share is L / b, so shares sum to L over the world.
        Per-sample-mean sinks scale their local mean by n_local / N instead (see module doc)."""
        preds = [st.inputs[(p, m)] for p in self.graph.predecessors(m)]
        placement = self.plan.placement(m)
        if self.global_batch[m]:
            preds = [self.comm.gather_batch(x, placement.gpus) for x in preds]
            st.keep.extend(preds)
        args = (*own, *preds)
        if self.config.graphs and not self.graphed and self.tensor_parallel[m] == 1:
            self._record_samples(m, args)
        result = self._ddp.get(m, self._callables[m][st.micro])(*args)
        if self.graph.successors(m):
            if not isinstance(result, torch.Tensor):
                raise EngineError(f"module {m!r} returned {type(result).__name__}; a module "
                                  "feeding others must return one tensor (batch first)")
            st.outputs[m] = result
            return
        if not isinstance(result, torch.Tensor) or result.dim() != 0:
            raise EngineError(f"sink {m!r} must return a scalar loss tensor, got "
                              f"{getattr(result, 'shape', type(result).__name__)}")
        dp = placement.dp_degree
        if self.global_batch[m]:
            st.losses[m] = result
            st.shares.append(result.detach() / dp)
        else:
            start, stop = self._sample_range(m)
            st.losses[m] = result * ((stop - start) / self.graph.global_batch * st.fraction)
            # Every GPU of a TP group computes the same loss: report it once over the group.
            st.shares.append(st.losses[m].detach() / self.tensor_parallel[m])

    def _backward_stage(self, t: int, st: _StepState, out: StepOutput, join: bool = True) -> None:
        ready = self._record(self._main)
        summing = self._start_sums_in_backward(t, st)
        for m in reversed(self.stage_modules[t]):
            stream = self._streams[m]
            with self._on(stream):
                self._wait(stream, ready)
                if self._homes[m].reduce_in_backward and m in self._in_graph:
                    for work in self._reducing:  # a later stage's sums on the communicator
                        stream_waits_for_sum(work)  # its captured ones are about to use
                start = self._mark(stream)
                if m in st.losses:
                    torch.autograd.backward(st.losses[m])
                elif st.outputs[m].requires_grad and m in st.grads:
                    torch.autograd.backward(st.outputs[m], st.grads[m])
                st.done[m] = self._record(stream)
                self._add_mark(out, m, t, "bwd", start, stream)
                if st.sync and self._grads_final_at_backward(m):
                    out.grads_ready[m] = (stream, st.done[m])
        routes = self._routes_into[t]
        if not join and not routes:  # one GPU, nothing flows back: let it run on (overlap)
            return
        self._main_waits(st, set(self.stage_modules[t]))
        self.comm.backward(routes, st.inputs, st.outputs, st.grads)
        for m in self.stage_modules[t]:
            if m in self._ddp or not st.sync:
                continue  # DDP reduced them during backward
            divide_by = self._divide_by(m)
            if self._homes[m].reduce_in_backward:  # graphed: the backward graph summed them
                self._reducing += summing[m].finish() if m in summing else []
                continue
            if self._homes[m].flat_sync:  # un-waited: the next stage's backward runs meanwhile
                self._reducing += self._flat_grads(m).reduce(
                    self.comm.group(self._grad_group(m)), divide_by, repair=m not in self._in_graph,
                    wire_dtype=REDUCE_DTYPES[self.config.reduce_dtype])
                continue
            group = self._grad_group(m)
            if len(group) == 1:  # nothing to sum: skip a host walk over the parameters
                continue
            # FSDP reduce-scattered a sharded module's gradients, but for the whole scalars
            params = self._whole_params[m] if m in self.sharded else self.modules[m].parameters()
            self.comm.all_reduce_grads(list(params), group, divide_by=divide_by,
                                       wire_dtype=REDUCE_DTYPES[self.config.reduce_dtype])

    def _start_sums_in_backward(self, t: int, st: _StepState) -> dict[str, InBackwardReduce]:
        """The eager modules of stage t whose flat buffer is summed during their backward,
        their hooks set (a graphed one's backward graph sums its own)."""
        if not st.sync:
            return {}
        started = {}
        for m in self.stage_modules[t]:
            if self._homes[m].reduce_in_backward and m not in self._in_graph:
                started[m] = self._in_backward_sum(m)
                started[m].start()
        return started

    def _divide_by(self, m: str) -> int:
        """What a summed gradient of module m is divided by: its DP degree where each replica
        computes the whole batch's gradient (a contrastive head needing the global batch),
        else 1 (the losses are scaled so that gradients sum; module doc)."""
        return self.plan.placement(m).dp_degree if self.global_batch[m] else 1

    def _in_backward_sum(self, m: str) -> InBackwardReduce:
        if m not in self._in_backward:
            self._in_backward[m] = InBackwardReduce(
                self._flat_grads(m), self.comm.group(self._grad_group(m)), divide_by=self._divide_by(m),
                wire_dtype=REDUCE_DTYPES[self.config.reduce_dtype])
        return self._in_backward[m]

    @property
    def grads_stay_put(self) -> bool:
        """Whether every module's gradients live in tensors its backward graph rewrites in
        place, which nothing frees, zeroes or (graphed.py) reuses between steps: an update may
        still read them while the next step's forward runs (update_gates.py)."""
        return self.graphed and all(
            self._homes[m].graph_mode in ("own", "copy") and m in self._in_graph
            and all(g.grads_outlive_forward for g in self._in_graph[m]) for m in self.local)

    def _grads_final_at_backward(self, m: str) -> bool:
        """Whether module m's gradients are final when its backward ends (no all-reduce, DDP,
        FSDP or TP after it; one backward per step)."""
        return (self.cuda and self.micro_batches == 1 and m not in self._ddp
                and m not in self.sharded and self.tensor_parallel[m] == 1
                and self.plan.placement(m).dp_degree == 1)

    def _flat_grads(self, m: str) -> FlatGrads:
        if m not in self._flat:
            self._flat[m] = FlatGrads(list(self.modules[m].parameters()))
        return self._flat[m]

    def attach_grads(self) -> None:
        """Start of an optimizer step: point gradients at the tensors the step writes (flat
        buffers zeroed where backwards add into them). The buffers are made at the first
        call, before any backward, so gradients never exist twice."""
        for m in self.local:
            home = self._homes[m]
            if home.flat:
                overwritten = m in self._in_graph and home.graph_mode == "copy"
                self._flat_grads(m).attach(zero=not overwritten)
            elif m in self._in_graph:
                for graphed in self._in_graph[m]:
                    graphed.attach()

    def _no_sync(self, sync: bool) -> Any:
        """DDP's `no_sync` on a micro-step that does not synchronise. Sharded modules
        reduce-scatter on every micro-step (FSDP2's default, torchtitan's choice): skipping it
        would keep each GPU a whole unsharded gradient until the last, the memory sharding
        was chosen to save (mosaic.sharding counts sharded gradients only)."""
        stack = contextlib.ExitStack()
        if not sync:
            for wrapped in self._ddp.values():
                stack.enter_context(wrapped.no_sync())
        return stack

    # --- streams and events (no-ops on CPU) ----------------------------------------------
    def _gates_active(self) -> Any:
        return self.gates.active() if self.gates is not None else contextlib.nullcontext()

    def _on(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _record(self, stream: Any) -> Any:
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _wait(self, stream: Any, event: Any) -> None:
        if self.cuda and stream is not self._main:
            stream.wait_event(event)

    def _main_waits(self, st: _StepState, modules: set[str]) -> None:
        if self.cuda:
            for m in sorted(modules):
                if m in st.done:
                    self._main.wait_event(st.done[m])

    def _mark(self, stream: Any) -> Mark | None:
        return self.timer.mark(stream) if self.record_timeline else None

    def _add_mark(self, out: StepOutput, m: str, t: int, phase: str, start: Mark | None,
                  stream: Any) -> None:
        if start is not None:
            out.marks.append((m, t, phase, start, self.timer.mark(stream)))

    # --- CUDA graphs ---------------------------------------------------------------------
    def _record_samples(self, m: str, args: tuple[torch.Tensor, ...]) -> None:
        # Real values, not empty_like: token ids must stay valid indices during warm-up.
        if self._samples is None:
            self._samples = {}
        self._samples[m] = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)

    def capture_graphs(self) -> None:
        """Capture every local module's forward and backward as CUDA graphs, each on the
        module's own stream. Needs one eager step first (it fixes the shapes)."""
        if not self.config.graphs or self.graphed:
            return
        graphed = [m for m in self.local  # TP and FSDP modules run their collectives uncaptured
                   if self.tensor_parallel[m] == 1 and m not in self.sharded]
        if self._samples is None and graphed:
            raise EngineError("capture_graphs() needs one eager step first: call step() once")
        torch.cuda.synchronize(self.device)
        side = torch.cuda.Stream(self.device)
        saved = torch.cuda.graph.default_capture_stream
        try:
            for m in graphed:
                # make_graphed_callables captures on graph.default_capture_stream. A graph
                # captured elsewhere and replayed on a green-context stream ignores the quota
                # (measured, DESIGN.md), so capture on the module's own stream. Temporal
                # modules run on the main stream, which may be the legacy default stream
                # (capture is illegal there) and has no quota: capture them on a side stream.
                stream = self._streams[m]
                torch.cuda.graph.default_capture_stream = side if stream is self._main else stream
                with self._gates_active():  # gated blocks capture their waits (update_gates.py)
                    self._callables[m] = [self._graph(m, eager, torch.cuda.graph.default_capture_stream)
                                          for eager in self._callables[m]]
        finally:
            torch.cuda.graph.default_capture_stream = saved
        torch.cuda.synchronize(self.device)
        self._samples = None
        self.graphed = True

    def _graph(self, m: str, eager: nn.Module, stream: Any) -> Any:
        samples = self._samples[m]
        mode = self._homes[m].graph_mode
        if mode is None:
            fresh_cublas_workspaces()
            return torch.cuda.make_graphed_callables(eager, samples, allow_unused_input=True)
        if mode == "own":
            params = list(self.modules[m].parameters())
            for p in params:  # the eager step's, replaced by the graph's at the next step
                p.grad = None  # (attach_grads): not held beside the capture's own
            graphed = InGraphGradModule(eager, params, samples, stream,
                                        grads_outlive_forward=self.gates is not None)
        else:
            flat = self._flat_grads(m)
            reducer = self._in_backward_sum(m) if self._homes[m].reduce_in_backward else None
            graphed = InGraphGradModule(eager, flat.params, samples, stream, mode, flat.views,
                                        reducer=reducer)
            if reducer is not None:
                reducer.agree_on_order()
            flat.leave_unattached(graphed.unused)
        self._in_graph.setdefault(m, []).append(graphed)
        return graphed

    # --- timeline ------------------------------------------------------------------------
    def timeline(self, out: StepOutput) -> list[dict[str, Any]]:
        """Start/end of each module's forward and backward, seconds from the step's start
        (synchronises: call after the timed region)."""
        events = []
        for m, stage, phase, start, end in out.marks:
            events.append({
                "module": m, "stage": stage, "gpu": self.rank, "phase": phase,
                "start_s": self.timer.seconds(out.start, start),
                "end_s": self.timer.seconds(out.start, end),
                "sm_share": self.plan.placement(m).sm_share,
            })
        return events
