"""The performance-model interface every model (analytic, profiled) implements.

A model answers three questions; everything else (stage time, iteration time, utilisation)
is composed here once, so the planners and the reports never care which model they use:

- `module_time_s`: forward + backward of one module alone on a GPU, for a per-GPU batch and
  an SM share (the scaling surface T(module, per-GPU batch, SM share)).
- `colocated_time_s`: time until every module of a group colocated on one GPU is done, in a
  sharing mode (temporal / partition / cap / free), interference included.
- `allreduce_s` / `transfer_s`: gradient all-reduce and activation transfer.

Tensor parallelism (mosaic.tensor_parallel) is composed here too: a TP shard's work is the
module's time at the replica's batch / t plus the TP group's all-reduces (`work_time_s`).
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace

from mosaic import sharding
from mosaic import tensor_parallel as tp
from mosaic.errors import MosaicError
from mosaic.graph import MMGraph, ModuleSpec
from mosaic.hardware import ClusterSpec, GPUSpec
from mosaic.plan import Placement, Plan, Stage

GRAD_BYTES_PER_PARAM = 4.0
"""Gradients are all-reduced in fp32 (mixed precision keeps fp32 master gradients)."""
ACCUMULATE_BYTES_PER_PARAM = 12.0
"""Adding a micro-step's fp32 gradients into the step's: read both, write the sum."""
IN_BACKWARD_BUCKET_BYTES = 25 * 2**20
"""The bucket the engine sums during a backward (grad_sync='overlapped'; a test checks it
against engine/bucket_reduce.py's)."""
BACKWARD_SHARE = 2 / 3
"""A module's backward's part of its forward + backward: each forward GEMM has two in the
backward (the input's gradient and the weight's)."""


def outlasting_s(comm_s: float, compute_s: float, pieces: int) -> float:
    """Of `comm_s` of communication in `pieces` equal parts, each running beside `compute_s`
    of compute that produces (or waits for) the parts evenly, one part at a time: what outlasts
    the compute. The last part ends at max(compute + comm/n, compute/n + comm), so
    max(comm/n, comm - compute (n-1)/n) is exposed."""
    n = max(1, pieces)
    return max(comm_s / n, comm_s - compute_s * (n - 1) / n)


class PerfModelError(MosaicError):
    """A performance model that cannot be made as asked (unknown name, unusable inputs)."""


@dataclass(frozen=True, slots=True)
class Work:
    """One module's share of a GPU inside a stage."""

    module: ModuleSpec
    per_gpu_batch: int
    """The replica's batch (global batch / DP degree); a TP group's GPUs share it."""
    sm_share: float = 1.0
    priority: int = 0
    tensor_parallel: int = 1
    """GPUs the replica is sharded over (this work is one shard)."""


class PerfModel(ABC):
    """Predicts times for plans on one cluster. Subclasses implement the three primitives."""

    name: str = "abstract"
    optimizer_bytes_per_param: float = 0.0
    """Device-memory traffic of one optimizer step per parameter, when `module_time_s` leaves it
    out (a measured forward+backward does; fused AdamW in fp32 moves about 28 bytes)."""

    accumulation: int = 1
    """Micro-steps per optimizer step (the engine's gradient accumulation, `accumulating`)."""

    micro_step_of: int = 1
    """Where this model plans one micro-step of an accumulated step (planners.one_micro_step),
    the micro-steps of that step K. What runs once a step, the unsharded gradient sync
    (`exposed_allreduce_s`) and the optimizer (`optimizer_s`), then counts 1/K in a
    micro-step's prediction, so that a plan search over one micro-step ranks plans as their
    whole steps rank (a sharded module's gathers and reduce-scatter repeat every micro-step:
    counted whole); `step_of_micro_s` predicts the whole step itself."""

    grad_wire_bytes: float = GRAD_BYTES_PER_PARAM
    """Bytes a parameter's gradient travels in when summed (2: the engine's
    reduce_dtype='bf16', which bf16 weights need on several GPUs)."""

    sums_in_backward: bool = False
    """Whether a plain data-parallel module's gradients are summed bucket by bucket during its
    own backward (the engine's grad_sync='overlapped'), not after it (`exposed_allreduce_s`)."""

    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster

    def accumulating(self, micro_steps: int) -> PerfModel:
        """This model, predicting iterations that run `micro_steps` micro-steps (each the plan
        at global_batch / micro_steps) per optimizer step; returns self."""
        if micro_steps < 1:
            raise PerfModelError(f"accumulation={micro_steps}: use 1 or more micro-steps")
        self.accumulation = micro_steps
        return self

    @abstractmethod
    def module_time_s(self, module: ModuleSpec, per_gpu_batch: int, sm_share: float = 1.0) -> float:
        """Forward + backward seconds of `module` alone on an SM share of one GPU."""

    @abstractmethod
    def colocated_time_s(self, works: Sequence[Work], sharing: str) -> float:
        """Seconds until all `works` sharing one GPU in mode `sharing` are done."""

    def describe(self) -> str:
        return self.name

    # --- tensor parallelism: composed from the primitives, so every model prices it alike ------
    def work_time_s(self, work: Work, sm_share: float) -> float:
        """Forward + backward of one work on `sm_share` of its GPU: a TP shard runs 1/t of the
        replica's compute at the replica's batch, then waits for the TP group's all-reduces."""
        alone = self.module_time_s(work.module, work.per_gpu_batch, sm_share)
        t = work.tensor_parallel
        return alone if t == 1 else alone / t + self.tp_comm_s(work.module, work.per_gpu_batch, t)

    def tp_comm_s(self, module: ModuleSpec, per_gpu_batch: int, tensor_parallel: int) -> float:
        """The TP all-reduces of one forward + backward, over `tensor_parallel` GPUs of a node."""
        if tensor_parallel <= 1:
            return 0.0
        one = self.allreduce_s(tp.allreduce_bytes(module, per_gpu_batch), tuple(range(tensor_parallel)))
        return tp.allreduces_per_step(module) * one

    def placement_allreduce_s(self, module: ModuleSpec, p: Placement) -> float:
        """Gradient all-reduce of a placed module: each TP shard's gradients over the GPUs
        holding that shard (the shards' all-reduces run at once, on disjoint GPUs). A sharded
        placement all-gathers and reduce-scatters instead (`sharded_sync_s`)."""
        if p.shard:
            return self.sharded_sync_s(module, p.gpus, p.shard_degree)
        num_bytes = module.num_params / p.tensor_parallel * self.grad_wire_bytes
        return self.allreduce_s(num_bytes, p.dp_groups[0])

    def edge_transfer_s(self, num_bytes: float, src: Placement, dst: Placement) -> float:
        """An edge's activations forward and their gradients back: every GPU of a TP consumer
        receives its replica's samples, every GPU of a TP producer their gradients. Ends on the
        same GPU list move nothing (slices stay local)."""
        forward = self.transfer_s(num_bytes * dst.tensor_parallel, src.gpus, dst.gpus)
        backward = self.transfer_s(num_bytes * src.tensor_parallel, src.gpus, dst.gpus)
        return forward + backward

    # --- communication: ring all-reduce and point-to-point from link bandwidths ---------------
    def allreduce_s(self, num_bytes: float, gpus: Sequence[int]) -> float:
        n = len(gpus)
        if n <= 1 or num_bytes <= 0:
            return 0.0
        if self.cluster.spans_nodes(list(gpus)):
            return self.hierarchical_allreduce_s(num_bytes, gpus)
        bandwidth = self.cluster.link_bandwidth_bps(list(gpus))
        steps = 2 * (n - 1)
        return steps * self.cluster.collective_latency_s / 4 + (steps / n) * num_bytes / bandwidth

    def hierarchical_allreduce_s(self, num_bytes: float, gpus: Sequence[int]) -> float:
        """NCCL's shape across nodes: reduce-scatter inside each node (NVLink), all-reduce of
        each GPU's shard with its peers on the other nodes (one NIC per GPU: rails), all-gather
        inside each node. The fullest node paces the in-node parts, the emptiest the shard."""
        counts = self.cluster.nodes_of(list(gpus))
        most, least = max(counts.values()), min(counts.values())
        in_node = (self.intra_node_collective_s("reduce_scatter", num_bytes, most)
                   + self.intra_node_collective_s("all_gather", num_bytes, most))
        return in_node + self.inter_node_allreduce_s(num_bytes / least, len(counts))

    def intra_node_collective_s(self, kind: str, num_bytes: float, num_gpus: int) -> float:
        """Reduce-scatter / all-gather of `num_bytes` over `num_gpus` GPUs of one node: a ring,
        n - 1 steps over NVLink (the profiled model uses its measured curves instead)."""
        if num_gpus <= 1:
            return 0.0
        n = num_gpus
        return ((n - 1) * self.cluster.collective_latency_s / 4
                + (n - 1) / n * num_bytes / self.cluster.intra_node_bandwidth_bps)

    def inter_node_allreduce_s(self, shard_bytes: float, num_nodes: int) -> float:
        """All-reduce of a shard over `num_nodes` rails: NCCL picks ring or tree, whichever
        has less latency (2(m-1) vs 2 log2 m hops); both reach the ring's bus bandwidth."""
        m = num_nodes
        if m <= 1:
            return 0.0
        hops = min(2 * (m - 1), 2 * math.ceil(math.log2(m)))
        bandwidth = self.cluster.gpu_inter_node_bandwidth_bps
        return hops * self.cluster.inter_node_latency_s + 2 * (m - 1) / m * shard_bytes / bandwidth

    def collective_s(self, kind: str, num_bytes: float, gpus: Sequence[int]) -> float:
        """An all-gather (`num_bytes`: the gathered size) or reduce-scatter (each GPU's whole
        input) as a ring: n - 1 steps over the slowest link of the set (the profiled model
        uses its measured curves instead)."""
        if kind not in ("all_gather", "reduce_scatter"):
            raise PerfModelError(f"collective kind {kind!r}; use 'all_gather' or 'reduce_scatter'")
        n = len(gpus)
        if n <= 1 or num_bytes <= 0:
            return 0.0
        hop_s = self.cluster.inter_node_latency_s if self.cluster.spans_nodes(list(gpus)) else 0.0
        return ((n - 1) * (self.cluster.collective_latency_s / 4 + hop_s)
                + (n - 1) / n * num_bytes / self.cluster.link_bandwidth_bps(list(gpus)))

    def sharded_sync_s(self, module: ModuleSpec, gpus: Sequence[int], shard_degree: int = 0) -> float:
        """A sharded module's communication per step, in place of its gradient all-reduce:
        its bf16 weights all-gathered in forward and again in backward, its gradients
        reduce-scattered in the reduce dtype (mosaic.sharding); all of it, of which the step
        waits for `exposed_sharded_sync_s`."""
        gather_s, scatter_s = self.sharded_collectives_s(module, gpus, shard_degree)
        return sharding.PARAM_ALL_GATHERS * gather_s + scatter_s

    def sharded_collectives_s(self, module: ModuleSpec, gpus: Sequence[int],
                              shard_degree: int = 0) -> tuple[float, float]:
        """(one all-gather of the module's weights, its gradients' reduce-scatter), seconds,
        inside each run of `shard_degree` of `gpus` (0: all of them; Placement.shard_degree).
        With several runs (HSDP) each GPU's reduce-scattered 1/k of the gradients is then
        all-reduced with the GPUs holding the same shard in the other runs, as FSDP2 does
        after each unit's reduce-scatter: counted with it."""
        k = shard_degree or len(gpus)
        group, grad_bytes = tuple(gpus[:k]), sharding.reduce_scatter_bytes(module, self.grad_wire_bytes)
        gather_s = self.collective_s("all_gather", sharding.all_gather_bytes(module), group)
        scatter_s = self.collective_s("reduce_scatter", grad_bytes, group)
        if k < len(gpus):
            scatter_s += self.allreduce_s(grad_bytes / k, tuple(gpus[::k]))
        return gather_s, scatter_s

    def transfer_s(self, num_bytes: float, src_gpus: Sequence[int], dst_gpus: Sequence[int]) -> float:
        """Moving a whole batch's activations from one GPU set to another (zero if same set).
        Across nodes each lane crosses on its GPU's share of the NICs, one fabric hop more."""
        if num_bytes <= 0 or list(src_gpus) == list(dst_gpus):
            return 0.0
        lanes = min(len(src_gpus), len(dst_gpus))
        gpus = list(src_gpus) + list(dst_gpus)
        bandwidth = self.cluster.link_bandwidth_bps(gpus)
        hop_s = self.cluster.inter_node_latency_s if self.cluster.spans_nodes(gpus) else 0.0
        return self.cluster.collective_latency_s + hop_s + num_bytes / (lanes * bandwidth)

    # --- composition ---------------------------------------------------------------------------
    def stage_works(self, stage: Stage, graph: MMGraph, batch: int | None = None) -> dict[int, list[Work]]:
        """Each GPU's works in the stage; `batch` overrides the global batch (a micro-batch)."""
        by_gpu: dict[int, list[Work]] = {}
        for p in stage.placements:
            m = graph.module(p.module)
            work = Work(m, (batch or graph.global_batch) // p.dp_degree, p.sm_share, p.priority,
                        p.tensor_parallel)
            for g in p.gpus:
                by_gpu.setdefault(g, []).append(work)
        return by_gpu

    def stage_compute_s(self, stage: Stage, graph: MMGraph, batch: int | None = None) -> float:
        """Slowest GPU of the stage: its colocated group's time."""
        groups = self.stage_works(stage, graph, batch)
        return max(self.colocated_time_s(works, stage.sharing) for works in groups.values())

    def stage_allreduce_s(self, stage: Stage, graph: MMGraph, sharded: bool | None = None) -> float:
        """Modules of a stage sync on their own groups at once; the slowest one counts.
        `sharded`: only the sharded placements (True) or only the others (False)."""
        times = [self.exposed_allreduce_s(graph.module(p.module), p, graph, stage)
                 for p in stage.placements if sharded is None or p.shard == sharded]
        return max(times, default=0.0)

    def exposed_allreduce_s(self, module: ModuleSpec, p: Placement, graph: MMGraph,
                            stage: Stage | None = None) -> float:
        """What the step waits for of a placed module's gradient sync: all of it after the
        module's backward, or (plain data-parallel placements whose backward runs alone on
        their GPUs in `stage`: a temporal stage, or no other placement there) `exposed_sum_s`,
        as the engine sums only those during the backward; a sharded placement's
        `exposed_sharded_sync_s`, wherever it runs (FSDP2 keeps streams of its own)."""
        if p.shard:
            return self.exposed_sharded_sync_s(module, graph.global_batch // p.dp_degree,
                                               p.sm_share, p.gpus, p.shard_degree)
        total = self.placement_allreduce_s(module, p)
        beside = stage is not None and not stage.runs_alone(p.module)
        if not (p.tensor_parallel > 1 or beside):
            total = self.exposed_sum_s(module, graph.global_batch // p.dp_degree, p.sm_share, total)
        return total / self.micro_step_of  # once a step: a micro-step's share

    def exposed_sum_s(self, module: ModuleSpec, per_gpu_batch: int, sm_share: float,
                      total_s: float) -> float:
        """Of a plain data-parallel module's all-reduce (`total_s`), what outlasts its backward
        when it is summed during that backward in n buckets of its gradient buffers (fp32, bf16
        for bf16 weights) (`sums_in_backward`; else all of it). With the backward B producing
        the buckets evenly and the sums A running one at a time, the last ends at
        max(B + A/n, B/n + A), so max(A/n, A - B (n-1)/n) is exposed.
        The sums' slowing of the backward's kernels is not counted. Accumulating micro-steps
        sum after the last one, as the engine does."""
        if not self.sums_in_backward or self.accumulation > 1 or total_s <= 0:
            return total_s
        backward = BACKWARD_SHARE * self.module_time_s(module, per_gpu_batch, sm_share)
        buffer_bytes = GRAD_BYTES_PER_PARAM * module.num_params - 2 * module.stored_bf16_params
        return outlasting_s(total_s, backward,
                            math.ceil(buffer_bytes / IN_BACKWARD_BUCKET_BYTES))

    def exposed_sharded_sync_s(self, module: ModuleSpec, per_gpu_batch: int, sm_share: float,
                               gpus: Sequence[int], shard_degree: int = 0) -> float:
        """What the step waits for of a sharded module's all-gathers and reduce-scatter
        (`sharded_sync_s`): FSDP2 gathers each unit (a layer, or the module's own parameters)
        on its own streams while the unit before it computes, in the forward and again in the
        backward, where it also reduce-scatters each unit's gradients as the next computes.
        So in each pass the units' communication outlasts the pass's compute only by
        `outlasting_s` over the units (a module without layers is one unit: none hidden).
        The collectives' slowing of the compute kernels is not counted. Accumulating, all of
        it repeats every micro-step (`accumulated_s`)."""
        gather_s, scatter_s = self.sharded_collectives_s(module, gpus, shard_degree)
        units = sharding.units(module)
        compute = self.module_time_s(module, per_gpu_batch, sm_share)
        backward = BACKWARD_SHARE * compute
        return (outlasting_s(gather_s, compute - backward, units)
                + outlasting_s(gather_s + scatter_s, backward, units))

    def stage_time_s(self, stage: Stage, graph: MMGraph) -> float:
        return self.stage_compute_s(stage, graph) + self.stage_allreduce_s(stage, graph)

    def transfers_s(self, plan: Plan, graph: MMGraph) -> float:
        """Activations forward and their gradients back, for edges whose ends sit apart."""
        total = 0.0
        for src, dst in graph.edges:
            a, b = plan.placement(src), plan.placement(dst)
            num_bytes = graph.module(src).output_bytes_per_sample * graph.global_batch
            total += self.edge_transfer_s(num_bytes, a, b)
        return total

    def optimizer_s(self, plan: Plan, graph: MMGraph) -> float:
        """The optimizer step after the last backward: the GPU holding the most parameters
        (a TP shard holds 1/t of its module's, a sharded placement 1/Placement.states_over);
        a micro-step's share of it where this model plans one (`micro_step_of`)."""
        return self.optimizer_step_s(self._most_params(plan, graph)) / self.micro_step_of

    @staticmethod
    def _most_params(plan: Plan, graph: MMGraph) -> float:
        """Parameters on the GPU holding the most (a TP shard holds 1/t of its module's, a
        sharded placement 1/Placement.states_over)."""
        return sum(graph.module(m).num_params * part for m, part in busiest_gpu_parts(plan, graph))

    def optimizer_step_s(self, num_params: float) -> float:
        """One optimizer step over `num_params` parameters on one GPU: its memory traffic at
        the datasheet bandwidth (0 where module times include the step)."""
        if self.optimizer_bytes_per_param <= 0:
            return 0.0
        return self.memory_pass_s(num_params, self.optimizer_bytes_per_param)

    def iteration_time_s(self, plan: Plan, graph: MMGraph) -> float:
        """T_iteration = sum over stages of T_stage (+ activation transfers between GPU sets,
        + the optimizer step where the module times leave it out)."""
        if self.accumulation > 1:
            return self.accumulated_s(plan, graph, self.accumulation)
        if plan.micro_batches > 1:
            stages_s = self.pipelined_s(plan, graph)
        else:
            stages_s = sum(self.stage_time_s(s, graph) for s in plan.stages)
        return stages_s + self.transfers_s(plan, graph) + self.optimizer_s(plan, graph)

    def accumulated_s(self, plan: Plan, graph: MMGraph, micro_steps: int) -> float:
        """Gradient accumulation as the engine runs it: every micro-step runs the plan's
        forward and backward at 1/micro_steps of the batch and adds its gradients into the
        step's (ACCUMULATE_BYTES_PER_PARAM each); the gradient all-reduce and the optimizer
        run once. A Unified-IO 2 `paper` trace at batch 16 as 4 x 4 found those adds at
        11.6 ms a micro-step and each micro-step repeating its batch-independent work. A
        sharded module gathers its weights and reduce-scatters its gradients on every
        micro-step (the engine keeps only sharded gradients), beside that micro-step's compute."""
        micro = replace(graph, global_batch=graph.global_batch // micro_steps)
        if plan.micro_batches > 1:
            compute_s = self.pipelined_s(plan, micro)
        else:
            compute_s = sum(self.stage_compute_s(s, micro) for s in plan.stages)
        compute_s += self.transfers_s(plan, micro)
        compute_s += sum(self.stage_allreduce_s(s, micro, sharded=True) for s in plan.stages)
        adds_s = self.memory_pass_s(self._most_params(plan, graph), ACCUMULATE_BYTES_PER_PARAM)
        sync_s = sum(self.stage_allreduce_s(s, graph, sharded=False) for s in plan.stages)
        return micro_steps * (compute_s + adds_s) + sync_s + self.optimizer_s(plan, graph)

    def step_of_micro_s(self, plan: Plan, micro: MMGraph) -> float:
        """The whole step of a plan made for one micro-step `micro` (`micro_step_of` of them
        accumulated), or the plan's own prediction where it is not a micro-step's."""
        k = self.micro_step_of
        if k == 1:
            return self.iteration_time_s(plan, micro)
        whole = copy.copy(self)
        whole.micro_step_of = 1
        return whole.accumulated_s(plan, replace(micro, global_batch=micro.global_batch * k), k)

    def memory_pass_s(self, num_params: float, bytes_per_param: float) -> float:
        """A memory-bound pass moving `bytes_per_param` over `num_params` parameters."""
        return num_params * bytes_per_param / self.cluster.gpu.mem_bandwidth_bps

    def pipelined_s(self, plan: Plan, graph: MMGraph) -> float:
        """One GPU, n micro-batches, the last stage L of micro-batch k running beside the
        earlier stages E of k+1 (forward) and of k-1 (backward): of the n (E + L) of a
        sequential run, n - 1 pairs overlap and take the time of E and L sharing the GPU
        freely: (E + L) + (n - 1) * T(E || L), all at the micro-batch size."""
        n, micro = plan.micro_batches, graph.global_batch // plan.micro_batches
        *early, last = plan.stages
        e_s = sum(self.stage_compute_s(s, graph, micro) for s in early)
        l_s = self.stage_compute_s(last, graph, micro)
        works = [w for s in plan.stages for ws in self.stage_works(s, graph, micro).values() for w in ws]
        pair_s = max(self.colocated_time_s(works, "free"), e_s, l_s)
        return e_s + l_s + (n - 1) * min(pair_s, e_s + l_s)

    def gpu_utilisation(self, plan: Plan, graph: MMGraph) -> float:
        """Busy SM-seconds over available SM-seconds in one iteration (0..1).

        A module busy for t seconds on share s of a GPU occupies s*t; a share of 1.0 of a module
        that cannot fill the GPU counts its saturation share (the reason colocation pays).
        """
        iteration_s = self.iteration_time_s(plan, graph)
        if iteration_s <= 0:
            return 0.0
        busy = 0.0
        for stage in plan.stages:
            for p in stage.placements:
                m = graph.module(p.module)
                b = graph.global_batch // p.dp_degree
                share = min(p.sm_share, self.saturation_share(m, b))
                busy += self.module_time_s(m, b, share) * share * p.dp_degree
        return min(1.0, busy / (iteration_s * self.cluster.num_gpus))

    def saturation_share(self, module: ModuleSpec, per_gpu_batch: int) -> float:
        """Smallest SM share beyond which the module gets (almost) no faster."""
        full = self.module_time_s(module, per_gpu_batch, 1.0)
        gpu = self.cluster.gpu
        for groups in range(1, gpu.num_sm_groups + 1):
            share = groups * gpu.sm_granularity / gpu.num_sms
            if self.module_time_s(module, per_gpu_batch, share) <= 1.05 * full:
                return share
        return 1.0

    def predict(self, plan: Plan, graph: MMGraph) -> Plan:
        note = (f"; {self.accumulation} accumulated micro-steps per step"
                if self.accumulation > 1 else "")
        return plan.with_prediction(self.iteration_time_s(plan, graph), self.describe() + note)


def guard_pass_s(plan: Plan, graph: MMGraph, gpu: GPUSpec) -> float:
    """The trainer's non-finite guard (engine/steps.py): one read of every gradient after the
    backward, on the GPU holding the most parameters: 2 bytes a bf16 weight's, 4 the others'.
    A bench step has no guard, so the module times and the engine term (fitted on bench runs)
    leave it out; `mosaic train` shows its prediction with it."""
    grad_bytes = sum((4 * graph.module(m).num_params - 2 * graph.module(m).stored_bf16_params)
                     * part for m, part in busiest_gpu_parts(plan, graph))
    return grad_bytes / gpu.mem_bandwidth_bps


def busiest_gpu_parts(plan: Plan, graph: MMGraph) -> list[tuple[str, float]]:
    """(module, part of its parameters) held by the GPU holding the most parameters: a TP
    shard holds 1/t of its module's, a sharded placement 1/Placement.states_over."""
    parts: dict[int, list[tuple[str, float]]] = {}
    for stage in plan.stages:
        for p in stage.placements:
            share = p.tensor_parallel * p.states_over
            for g in p.gpus:
                parts.setdefault(g, []).append((p.module, 1.0 / share))
    return max(parts.values(), default=[],
               key=lambda held: sum(graph.module(m).num_params * part for m, part in held))
