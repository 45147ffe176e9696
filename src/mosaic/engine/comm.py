"""Process groups and data movement of a plan: one process per GPU, rank r = GPU id r.

Sample layout. A module placed on GPUs (g_0, ..., g_{d-1}) (DP degree d) holds samples
[i*N/d, (i+1)*N/d) of the global batch N on g_i (the order of the placement's `gpus`).
Moving a producer's output to a consumer on another GPU set is then interval arithmetic:
every overlap of a producer interval with a consumer interval is one `Piece`, sent with
batched point-to-point ops, or sliced locally when both ends are the same rank. This is right
for any pair of DP degrees (2 -> 3 works as well as 4 -> 2). Gradients travel the same pieces
backwards and are summed into the producer's output gradient.

Tensor parallelism. A placement with tensor_parallel t has d = len(gpus) / t replicas, each on
t consecutive GPUs that all hold the replica's samples. Forward, every GPU of a TP consumer
receives its replica's samples (GPU q of a group from GPU q mod t' of a TP producer's group,
whose replicas are identical); backward, every GPU of a TP producer needs its samples'
gradient, taken from one GPU of the consumer's group (the others hold the same one). So a
route has forward `pieces` and backward `grad_pieces`; without TP they are the same pieces.

Ordering. Every rank walks the same global sequence of communication phases (stage by stage,
edge by edge, module by module, in plan order) and joins only those it takes part in, so
two ranks always meet their shared phases in the same order: no deadlock, with gloo or NCCL.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mosaic.engine.tensor_parallel import local_tensor
from mosaic.errors import MosaicError
from mosaic.graph import MMGraph
from mosaic.plan import Plan

Key = tuple[str, str]
"""An edge (producer module, consumer module)."""

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64,
           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_MAX_DIMS = 8
BUCKET_ELEMENTS = 25 * 2**20
"""Gradients are all-reduced in flat buckets of at most this many elements (100 MB fp32)."""


class CommError(MosaicError):
    """A plan that cannot be laid out on the running processes; the message says the fix."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Samples [start, stop) of the global batch, held by rank `src`, needed by rank `dst`."""

    src: int
    dst: int
    start: int
    stop: int


def sample_range(global_batch: int, gpus: Sequence[int], rank: int,
                 tensor_parallel: int = 1) -> tuple[int, int]:
    """[start, stop) of the global batch that `rank` holds in a placement on `gpus` (every GPU
    of a TP group holds its replica's range)."""
    per_replica = global_batch * tensor_parallel // len(gpus)
    index = list(gpus).index(rank) // tensor_parallel
    return index * per_replica, (index + 1) * per_replica


def _replicas(gpus: Sequence[int], tensor_parallel: int) -> list[tuple[int, ...]]:
    gpus = tuple(gpus)
    return [gpus[i:i + tensor_parallel] for i in range(0, len(gpus), tensor_parallel)]


def _overlap(global_batch: int, i: int, n_src: int, j: int, n_dst: int) -> tuple[int, int]:
    per_src, per_dst = global_batch // n_src, global_batch // n_dst
    return max(j * per_dst, i * per_src), min((j + 1) * per_dst, (i + 1) * per_src)


def pieces(global_batch: int, src_gpus: Sequence[int], dst_gpus: Sequence[int],
           src_tp: int = 1, dst_tp: int = 1) -> list[Piece]:
    """Forward: overlaps of producer and consumer replicas' intervals, for every consumer GPU
    (GPU q of a consumer group takes from GPU q mod src_tp of the producer's), by consumer
    rank then sample order."""
    src, dst, out = _replicas(src_gpus, src_tp), _replicas(dst_gpus, dst_tp), []
    for j, group in enumerate(dst):
        for q, rank in enumerate(group):
            for i, sources in enumerate(src):
                start, stop = _overlap(global_batch, i, len(src), j, len(dst))
                if start < stop:
                    out.append(Piece(sources[q % src_tp], rank, start, stop))
    return out


def grad_pieces(global_batch: int, src_gpus: Sequence[int], dst_gpus: Sequence[int],
                src_tp: int = 1, dst_tp: int = 1) -> list[Piece]:
    """Backward: what each producer GPU needs of the gradient (GPU p of a producer group from
    GPU p mod dst_tp of each consumer group), by consumer rank then sample order. Without TP
    the forward pieces."""
    if src_tp == dst_tp == 1:
        return pieces(global_batch, src_gpus, dst_gpus)
    src, dst, out = _replicas(src_gpus, src_tp), _replicas(dst_gpus, dst_tp), []
    for i, group in enumerate(src):
        for p, rank in enumerate(group):
            for j, consumers in enumerate(dst):
                start, stop = _overlap(global_batch, i, len(src), j, len(dst))
                if start < stop:
                    out.append(Piece(rank, consumers[p % dst_tp], start, stop))
    return sorted(out, key=lambda piece: (piece.dst, piece.start, piece.src))


@dataclass(frozen=True, slots=True)
class Route:
    """How one edge's activations move between the producer's and the consumer's GPU sets."""

    src: str
    dst: str
    src_gpus: tuple[int, ...]
    dst_gpus: tuple[int, ...]
    global_batch: int
    pieces: tuple[Piece, ...]
    """Forward: the producer's output to the consumer's GPUs."""
    grad_pieces: tuple[Piece, ...]
    """Backward: the consumer's input gradients to the producer's GPUs (see module doc)."""
    src_tp: int = 1
    dst_tp: int = 1

    @property
    def key(self) -> Key:
        return (self.src, self.dst)

    def src_start(self, rank: int) -> int:
        return sample_range(self.global_batch, self.src_gpus, rank, self.src_tp)[0]

    def dst_start(self, rank: int) -> int:
        return sample_range(self.global_batch, self.dst_gpus, rank, self.dst_tp)[0]


def routes_for(plan: Plan, graph: MMGraph) -> list[Route]:
    """One route per graph edge, in the graph's edge order (the same on every rank)."""
    routes = []
    for src, dst in graph.edges:
        a, b = plan.placement(src), plan.placement(dst)
        ends = (graph.global_batch, a.gpus, b.gpus, a.tensor_parallel, b.tensor_parallel)
        routes.append(Route(src, dst, a.gpus, b.gpus, graph.global_batch, tuple(pieces(*ends)),
                            tuple(grad_pieces(*ends)), a.tensor_parallel, b.tensor_parallel))
    return routes


def gpu_sets(plan: Plan) -> list[tuple[int, ...]]:
    """Distinct GPU sets of the plan's placements, of their TP groups and of the GPUs
    holding the same shard (Placement.tp_groups / dp_groups), and of HSDP's sharded copies and
    their replicas (Placement.shard_groups / replica_groups), sorted: the process groups to
    create."""
    sets = set()
    for stage in plan.stages:
        for p in stage.placements:
            sets.add(tuple(sorted(p.gpus)))
            if p.tensor_parallel > 1:
                sets.update(tuple(sorted(g)) for g in (*p.tp_groups, *p.dp_groups))
            if len(p.shard_groups) > 1:
                sets.update(tuple(sorted(g)) for g in (*p.shard_groups, *p.replica_groups))
    return sorted(sets)


def check_world_size(plan: Plan, world_size: int) -> None:
    if world_size != plan.num_gpus:
        raise CommError(
            f"plan needs num_gpus={plan.num_gpus} processes (one per GPU) but {world_size} "
            f"{'is' if world_size == 1 else 'are'} running; launch with "
            f"`torchrun --nproc-per-node {plan.num_gpus}` or re-plan with --gpus {world_size}")


class PlanComm:
    """This rank's process groups and the plan's collective and point-to-point traffic.

    Without an initialised process group it runs a one-rank world: every piece is local.
    """

    def __init__(self, *, rank: int, world_size: int, device: torch.device,
                 groups: dict[tuple[int, ...], object | None]) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self._groups = groups
        self._known_shapes: dict[Key, tuple[tuple[int, ...], torch.dtype]] = {}

    @classmethod
    def create(cls, plan: Plan, device: torch.device | str = "cpu") -> PlanComm:
        """Check the world size, then create one group per distinct GPU set, on every rank
        in the same order (new_group is collective over the whole world)."""
        distributed = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size() if distributed else 1
        rank = dist.get_rank() if distributed else 0
        check_world_size(plan, world_size)
        groups: dict[tuple[int, ...], object | None] = {}
        for gpus in gpu_sets(plan):
            if len(gpus) == 1:
                groups[gpus] = None
            elif len(gpus) == world_size:
                groups[gpus] = dist.group.WORLD
            else:
                groups[gpus] = dist.new_group(list(gpus))
        return cls(rank=rank, world_size=world_size, device=torch.device(device), groups=groups)

    def group(self, gpus: Sequence[int]) -> object | None:
        """The process group of a GPU set; None for a single GPU (nothing to communicate)."""
        return self._groups[tuple(sorted(gpus))]

    def close(self) -> None:
        """Drop this plan's group handles, so destroying the world frees them (session.py
        end_distributed); the comm cannot be used afterwards."""
        self._groups = {}

    # --- point to point ------------------------------------------------------------------
    def _exchange(self, sends: list[tuple[torch.Tensor, int]],
                  recvs: list[tuple[torch.Tensor, int]]) -> None:
        """Post all sends and receives as one batch and wait. Both ends list a pair's
        messages in the same (global piece) order, which is how they are matched."""
        ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def _learn_shapes(self, routes: Sequence[Route], outputs: dict[str, torch.Tensor]) -> None:
        """First use of a route: producers tell remote consumers the per-sample shape and
        dtype (shapes are static, so this runs once per route)."""
        todo = [r for r in routes if r.key not in self._known_shapes]
        sends, recvs, headers = [], [], []
        for r in todo:
            for p in r.pieces:
                if p.src == self.rank:
                    out = outputs[r.src]
                    self._known_shapes[r.key] = (tuple(out.shape[1:]), out.dtype)
                    if p.dst != self.rank:
                        sends.append((_encode_header(out, self.device), p.dst))
                elif p.dst == self.rank:
                    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
                    recvs.append((header, p.src))
                    headers.append((r.key, header))
        self._exchange(sends, recvs)
        for key, header in headers:
            self._known_shapes.setdefault(key, _decode_header(header))

    def forward(self, routes: Sequence[Route],
                outputs: dict[str, torch.Tensor]) -> dict[Key, torch.Tensor]:
        """The consumer inputs this rank needs for `routes`: its samples of each producer's
        output, gathered from local slices and point-to-point receives."""
        self._learn_shapes(routes, outputs)
        sends, recvs, parts = [], [], {}
        for r in routes:
            for p in r.pieces:
                if p.src == self.rank:
                    offset = r.src_start(self.rank)
                    view = outputs[r.src][p.start - offset:p.stop - offset]
                    if p.dst == self.rank:
                        parts[(r.key, p)] = view
                    else:
                        sends.append((view.contiguous(), p.dst))
                elif p.dst == self.rank:
                    shape, dtype = self._known_shapes[r.key]
                    buf = torch.empty((p.stop - p.start, *shape), dtype=dtype, device=self.device)
                    recvs.append((buf, p.src))
                    parts[(r.key, p)] = buf
        self._exchange(sends, recvs)
        inputs = {}
        for r in routes:
            mine = [parts[(r.key, p)] for p in r.pieces if p.dst == self.rank]
            if mine:  # a single local piece is passed as a view: no copy
                inputs[r.key] = mine[0] if len(mine) == 1 else torch.cat(mine)
        return inputs

    def backward(self, routes: Sequence[Route], inputs: dict[Key, torch.Tensor],
                 outputs: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
        """Send each consumer input's gradient back along its pieces and add what arrives into
        `grads[producer]` (several consumers of one producer sum up)."""
        sends, recvs, arrivals = [], [], []
        for r in routes:
            for p in r.grad_pieces:
                if p.dst == self.rank:
                    x = inputs[r.key]
                    g = x.grad if x.grad is not None else torch.zeros_like(x)
                    offset = r.dst_start(self.rank)
                    piece = g[p.start - offset:p.stop - offset]
                    if p.src == self.rank:
                        arrivals.append((r, p, piece))
                    else:
                        sends.append((piece.contiguous(), p.src))
                elif p.src == self.rank:
                    out = outputs[r.src]
                    buf = torch.empty((p.stop - p.start, *out.shape[1:]), dtype=out.dtype,
                                      device=out.device)
                    recvs.append((buf, p.dst))
                    arrivals.append((r, p, buf))
        self._exchange(sends, recvs)
        for r, p, g in arrivals:
            if r.src not in grads:
                grads[r.src] = torch.zeros_like(outputs[r.src])
            offset = r.src_start(self.rank)
            grads[r.src][p.start - offset:p.stop - offset] += g

    # --- collectives -------------------------------------------------------------------
    def gather_batch(self, live: torch.Tensor, gpus: Sequence[int]) -> torch.Tensor:
        """The whole batch of a tensor sharded over `gpus`, in sample order; the local slice
        is `live` itself so gradients reach this rank's producers (others are detached)."""
        group = self.group(gpus)
        if group is None:
            return live
        parts = [torch.empty_like(live) for _ in gpus]
        dist.all_gather(parts, live.detach().contiguous(), group=group)
        by_rank = dict(zip(dist.get_process_group_ranks(group), parts, strict=True))
        by_rank[self.rank] = live
        return torch.cat([by_rank[g] for g in gpus])

    def all_reduce_grads(self, params: Sequence[torch.nn.Parameter], gpus: Sequence[int],
                         divide_by: int = 1, wire_dtype: torch.dtype | None = None) -> None:
        """SUM-all-reduce the parameters' gradients over the GPU set's group, in buckets that
        travel in `wire_dtype` (default: the gradients'), divided before the sum as FlatGrads
        and the DDP hook do: the step before DDP wraps a module (runner.py) then sums exactly
        as the DDP steps after it, so a run resumed from a checkpoint repeats its steps."""
        group = self.group(gpus)
        if group is None:
            return
        grads = []
        for p in params:
            if p.requires_grad:
                if p.grad is None:  # every replica must send the same buckets
                    p.grad = torch.zeros_like(p)
                grads.append(local_tensor(p.grad))  # a TP shard's: over its DP group
        for bucket in _buckets(grads):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            if wire_dtype is not None and flat.dtype != wire_dtype:
                flat = flat.to(wire_dtype)
            if divide_by != 1:
                flat.div_(divide_by)  # sum of the shares = share of the sum; bf16 keeps its range
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def broadcast_bytes(payload: bytes | None, device: torch.device | str, src: int = 0) -> bytes:
    """`payload` of rank `src` on every rank of the world (e.g. a plan's JSON, so that all
    ranks run the plan one rank made); the payload itself when no process group runs."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return payload or b""
    size = torch.tensor([len(payload or b"")], dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    data = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == src and payload:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    if data.numel():
        dist.broadcast(data, src)
    return data.cpu().numpy().tobytes()


def share_from_rank0(make: Callable[[], dict[str, Any]], device: torch.device | str) -> dict[str, Any]:
    """`make()` runs on rank 0 and every rank gets its JSON result (a plan, say: a planner with
    a time limit need not be deterministic). A failure on rank 0 is sent instead, so every rank
    raises the same one-line error rather than hanging in the broadcast."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    payload = None
    if rank == 0:
        try:
            payload = json.dumps({"value": make()})
        except Exception as exc:  # every rank must hear of it, not hang
            if not isinstance(exc, ValueError):
                raise
            payload = json.dumps({"error": str(exc), "type": type(exc).__name__})
    message = json.loads(broadcast_bytes(payload.encode() if payload else None, device))
    if "error" in message:
        raise CommError(message["error"])
    return message["value"]


class FlatGrads:
    """One module's gradients as views into one flat buffer per dtype: for a data-parallel
    module, summed over its group by one all-reduce per buffer: no per-step concatenation, no
    copy back, no per-parameter hook (`grad_sync="flat"`, Megatron's contiguous gradient
    buffer); a backward graph may also write into the views itself (graphed.py).

    `attach()` at the start of a step zeroes the buffers and points every `.grad` at its view,
    so autograd's AccumulateGrad adds into them in place. Whoever replaced a `.grad` since
    (a new tensor, or None) is repaired in `reduce()` by a copy into the view, so the sum is
    right however the caller zeroes gradients. A parameter without a gradient contributes
    zeros (as with the bucketed all-reduce), so every replica sends the same buffers.
    `reduce()` divides before summing and returns the collectives un-waited, so the caller
    can run the next stage's backward while they travel and wait before the optimizer.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        sizes: dict[torch.dtype, int] = {}
        for p in self.params:
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
        device = self.params[0].device if self.params else torch.device("cpu")
        self.buffers = {dtype: torch.zeros(n, dtype=dtype, device=device)
                        for dtype, n in sizes.items()}
        offsets = dict.fromkeys(sizes, 0)
        self.views = []
        self.offsets: list[int] = []
        """Where each parameter's view starts in its dtype's buffer (elements)."""
        for p in self.params:
            start = offsets[p.dtype]
            self.views.append(self.buffers[p.dtype][start:start + p.numel()].view_as(p))
            self.offsets.append(start)
            offsets[p.dtype] = start + p.numel()
        self.attached = list(zip(self.params, self.views, strict=True))

    def leave_unattached(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Parameters that get no gradient (unused by the module's forward): their `.grad`
        stays None, so the optimizer skips them as it would eagerly; their views stay zero."""
        skip = {id(p) for p in params}
        self.attached = [(p, v) for p, v in zip(self.params, self.views, strict=True)
                         if id(p) not in skip]

    def attach(self, zero: bool = True) -> None:
        """`zero=False` where every view is rewritten whole before it is read (a backward
        graph that copies its gradients in, graphed.py)."""
        if zero:
            for buffer in self.buffers.values():
                buffer.zero_()
        for p, view in self.attached:
            p.grad = view

    def reduce(self, group: object, divide_by: int = 1, repair: bool = True,
               wire_dtype: torch.dtype | None = None) -> list[Any]:
        """`repair=False` where nothing can have replaced a `.grad` since `attach()` (a
        backward graph wrote the views): skips a host loop over the parameters.
        `wire_dtype` (bf16): the sum travels in it, as Megatron's and FSDP's mixed-precision
        reduction do, and is written back when the returned handle is waited for."""
        for p, view in self.attached if repair else ():
            grad_into_view(p, view)
        return [sum_piece(buffer, group, divide_by, wire_dtype) for buffer in self.buffers.values()]


def grad_into_view(param: torch.nn.Parameter, view: torch.Tensor) -> None:
    """`param`'s gradient into `view` (zeros where it has none) and `.grad` pointed at it,
    where it was left elsewhere (a `.grad` set to None or replaced since FlatGrads.attach)."""
    grad = param.grad
    if grad is None:
        view.zero_()
    elif grad.data_ptr() != view.data_ptr():
        view.copy_(grad)
    param.grad = view


def sum_piece(piece: torch.Tensor, group: object, divide_by: int = 1,
              wire_dtype: torch.dtype | None = None, async_op: bool = True) -> Any:
    """SUM-all-reduce `piece` (a flat buffer or a slice of one) in place over `group`, divided
    first (sum of the shares = share of the sum), travelling in `wire_dtype` (default: its
    own). Async: the handle, whose wait() also writes a cast sum back; else None."""
    if divide_by != 1:
        piece.div_(divide_by)
    if wire_dtype is None or wire_dtype == piece.dtype:
        return dist.all_reduce(piece, group=group, async_op=async_op)
    wire = piece.to(wire_dtype)
    work = dist.all_reduce(wire, group=group, async_op=async_op)
    if async_op:
        return _WrittenBack(work, wire, piece)
    piece.copy_(wire)
    return None


def stream_waits_for_sum(work: Any) -> None:
    """The current stream waits for a sum in flight (a handle `FlatGrads.reduce` returned),
    not for its cast copy back, which waiting for the handle itself does later."""
    (work.work if isinstance(work, _WrittenBack) else work).wait()


class _WrittenBack:
    """An all-reduce of a cast copy; waiting for it copies the sum back into the buffer."""

    def __init__(self, work: Any, wire: torch.Tensor, buffer: torch.Tensor) -> None:
        self.work, self.wire, self.buffer = work, wire, buffer

    def wait(self) -> None:
        self.work.wait()
        self.buffer.copy_(self.wire)


def _buckets(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        same_dtype = buckets and buckets[-1][0].dtype == g.dtype
        if not buckets or not same_dtype or size + g.numel() > BUCKET_ELEMENTS:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.numel()
    return buckets


def _encode_header(out: torch.Tensor, device: torch.device) -> torch.Tensor:
    if out.dim() - 1 > _MAX_DIMS or out.dtype not in _DTYPES:
        raise CommError(f"cannot send a {out.dtype} tensor of shape {tuple(out.shape)}: "
                        f"use one of {_DTYPES} with at most {_MAX_DIMS + 1} dims")
    dims = list(out.shape[1:]) + [0] * (_MAX_DIMS - out.dim() + 1)
    return torch.tensor([_DTYPES.index(out.dtype), out.dim() - 1, *dims],
                        dtype=torch.int64, device=device)


def _decode_header(header: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    values = [int(v) for v in header.tolist()]
    return tuple(values[2:2 + values[1]]), _DTYPES[values[0]]
