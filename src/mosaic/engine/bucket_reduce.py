"""A data-parallel module's flat gradient buffer summed bucket by bucket inside its backward
(`grad_sync="overlapped"`), as DDP overlaps its buckets with the backward; `flat` sums the
whole buffer after the module's backward instead.

Why: a large module's sum after its own backward has little left to hide under. The
performance model predicts Unified-IO 2 `paper` at 4 samples a GPU at 85.93 ms on one H200
and 131.19 ms on two (1.31x the throughput, against the 1.85x a user expects of weak
scaling): the LLM's 3.6 B fp32 gradients are about 40 ms of NVLink, and only the encoders'
short backward runs after the LLM's. Summed during the backward: 99.00 ms (1.74x), predicted
(docs/engine.md, "Summing inside the backward graph").

Buckets (`buckets_of`). Per dtype, the module's parameters in reverse order (roughly the
order the backward produces their gradients) cut into runs of at least `bucket_bytes`; a run
is one slice of the dtype's flat buffer, since comm.FlatGrads lays the views end to end in
parameter order. A bucket is summed once every parameter it awaits has its gradient. Every
rank must issue the same collectives in the same order: a captured backward sums each bucket
as it completes, since the order they complete in is fixed by the backward's graph and the
same on every rank (`agree_on_order` checks it after the capture, so a parameter registered
late but used early holds back no other bucket); an eager one sums them strictly in one
order (by where their awaited parameters start, latest first), since its gradients arrive
as the step's data uses the parameters. A parameter not awaited (one the module leaves
unused) keeps a zero view, summed with its bucket.

Two ways the gradients arrive:

- captured (`InBackwardReduce.captured`), inside a module's backward CUDA graph
  (graphed.py, "copy" mode): a tensor hook on each parameter receives its gradient from
  `torch.autograd.grad`; a complete bucket's gradients are copied into its slice, which is
  summed on a side stream forked from the capture stream and joined before the capture
  ends, so each replay runs the sums between the backward's own kernels, with no host work.
  The communicator must exist before the capture: the engine's first step is eager and
  sums through the same group.
- eager (`start` / `finish`): a post-accumulate hook on each parameter (AccumulateGrad has
  added into its view) starts the bucket's sum un-waited; `finish`, after the backward,
  sums the buckets still short of a gradient (parameters unused this step) and returns the
  collectives for the caller to wait on before the optimizer.

Only for a module whose backward runs alone on its GPUs (plan.Stage.runs_alone): two
modules' captured sums replayed side by side would meet on one communicator in an order no
rank controls.

Not measured on two GPUs yet (benchmarks/captured_reduce_probe.py first, then `mosaic bench
--engine-variant grad_sync=overlapped`): `flat` stays the default until it pays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mosaic.engine.comm import FlatGrads, grad_into_view, sum_piece
from mosaic.errors import MosaicError

BUCKET_BYTES = 25 * 2**20
"""DDP's default bucket size (`bucket_cap_mb=25`), not yet tuned on the GPU."""


class BucketReduceError(MosaicError):
    """A backward that did not produce every gradient its buckets await."""


@dataclass(frozen=True, slots=True)
class Bucket:
    """One slice [start, stop) of the flat buffer of `dtype`, summed as one collective once
    the gradients of `awaited` (indices into FlatGrads.params) have arrived."""

    dtype: torch.dtype
    start: int
    stop: int
    awaited: tuple[int, ...]


def buckets_of(flat: FlatGrads, bucket_bytes: int,
               awaited: Collection[int] | None = None) -> list[Bucket]:
    """`flat`'s buffers in buckets (module doc), in the order they are summed. `awaited`:
    indices of the parameters whose gradients arrive (None: all); a bucket awaiting none
    holds only zeros and is left out."""
    runs: list[list[int]] = []
    for dtype in flat.buffers:
        run: list[int] = []
        size = 0
        for i in reversed(range(len(flat.params))):
            p = flat.params[i]
            if p.dtype != dtype:
                continue
            run.append(i)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                runs.append(run)
                run, size = [], 0
        if run:
            runs.append(run)
    buckets = []
    for run in runs:
        waits = tuple(i for i in run if awaited is None or i in awaited)
        if waits:
            first, last = min(run), max(run)
            buckets.append(Bucket(flat.params[first].dtype, flat.offsets[first],
                                  flat.offsets[last] + flat.params[last].numel(), waits))
    # the bucket whose awaited gradients reach furthest back completes last
    return sorted(buckets, key=lambda b: -min(b.awaited))


class InBackwardReduce:
    """Sums one module's flat gradient buffers over `group` bucket by bucket as its backward
    produces them (module doc), divided by `divide_by` first, travelling in `wire_dtype`."""

    def __init__(self, flat: FlatGrads, group: object, *, divide_by: int = 1,
                 wire_dtype: torch.dtype | None = None, bucket_bytes: int | None = None) -> None:
        self.flat, self.group = flat, group
        self.divide_by, self.wire_dtype = divide_by, wire_dtype
        self.bucket_bytes = bucket_bytes or BUCKET_BYTES
        self._index = {id(p): i for i, p in enumerate(flat.params)}
        self._every = buckets_of(flat, self.bucket_bytes)
        self.buckets: list[Bucket] = self._every
        self._missing: list[set[int]] = []
        self._position: dict[int, int] = {}
        self._next = 0
        self.order: list[int] = []
        """Positions in `buckets` in the order their sums were issued (the last backward's)."""
        self._grads: dict[int, torch.Tensor] = {}
        self._works: list[Any] = []
        self._handles: list[Any] = []
        on_gpu = bool(flat.params) and flat.params[0].is_cuda
        self._side = torch.cuda.Stream(flat.params[0].device) if on_gpu else None
        """The captured sums' stream, made before any capture (as the probe's)."""

    def _arm(self, buckets: list[Bucket]) -> None:
        self.buckets, self._next, self._works, self.order = buckets, 0, [], []
        self._missing = [set(b.awaited) for b in buckets]
        self._position = {i: k for k, b in enumerate(buckets) for i in b.awaited}

    def _arrived(self, i: int, sum_bucket: Callable[[Bucket], None], in_order: bool) -> None:
        """Parameter i's gradient is in: sum the buckets it completes; `in_order`: only in
        the buckets' order (a bucket waits for the ones before it)."""
        position = self._position.get(i)
        if position is not None:
            self._missing[position].discard(i)
            if not in_order and not self._missing[position]:
                self.order.append(position)
                sum_bucket(self.buckets[position])
        while in_order and self._next < len(self.buckets) and not self._missing[self._next]:
            self.order.append(self._next)
            sum_bucket(self.buckets[self._next])
            self._next += 1

    def _piece(self, bucket: Bucket) -> torch.Tensor:
        return self.flat.buffers[bucket.dtype][bucket.start:bucket.stop]

    # --- inside a backward CUDA graph ---------------------------------------------------
    @contextlib.contextmanager
    def captured(self, used: Sequence[nn.Parameter]) -> Iterator[None]:
        """Around the `torch.autograd.grad` of a backward being captured: hooks on `used`
        (the parameters that get gradients) sum each complete bucket on a side stream, joined
        on leaving. The caller copies no gradients itself."""
        awaited = {self._index[id(p)] for p in used}
        self._arm(buckets_of(self.flat, self.bucket_bytes, awaited))
        side = self._side
        if side is None and self.buckets:
            raise BucketReduceError("a captured backward sums CUDA gradients: this module's "
                                    "are on the CPU")
        handles = [p.register_hook(partial(self._received, self._index[id(p)], side))
                   for p in used]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        self._grads.clear()
        if len(self.order) != len(self.buckets):
            raise BucketReduceError(f"the captured backward left {len(self.buckets) - len(self.order)}"
                                    f" of {len(self.buckets)} gradient buckets incomplete: a "
                                    "parameter used in the warm-up got no gradient; use "
                                    "grad_sync='flat'")
        if self.buckets:  # join the side stream only where a sum forked it into the capture
            torch.cuda.current_stream().wait_stream(side)

    def _received(self, i: int, side: torch.cuda.Stream, grad: torch.Tensor) -> None:
        # The order buckets complete in is fixed by the backward's graph, the same on every
        # rank capturing the same module on same-shaped inputs: no bucket need wait for
        # another (agree_on_order checks it after the capture).
        self._grads[i] = grad
        self._arrived(i, partial(self._sum_captured, side), in_order=False)

    def _sum_captured(self, side: torch.cuda.Stream, bucket: Bucket) -> None:
        torch._foreach_copy_([self.flat.views[i] for i in bucket.awaited],
                             [self._grads.pop(i) for i in bucket.awaited])
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            sum_piece(self._piece(bucket), self.group, self.divide_by, self.wire_dtype,
                      async_op=False)

    def agree_on_order(self) -> None:
        """After a capture, outside it: every rank of the group issued the same sums in the
        same order (NCCL pairs collectives by order, so a difference would hang or mix two
        buckets' sums); a clear error where not."""
        mine = [(str(b.dtype), b.start, b.stop) for b in (self.buckets[k] for k in self.order)]
        orders: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(orders, mine, group=self.group)
        differ = [rank for rank, order in enumerate(orders) if order != orders[0]]
        if differ:
            raise BucketReduceError(f"group ranks {differ} captured their gradient sums in "
                                    "another order than the group's first: the module's "
                                    "backward differs between ranks; use grad_sync='flat'")

    # --- eager backward ------------------------------------------------------------------
    def start(self) -> None:
        """Before the module's backward: hooks on every parameter's gradient accumulation."""
        self._arm(self._every)
        self._handles = [p.register_post_accumulate_grad_hook(partial(self._accumulated, i))
                         for i, p in enumerate(self.flat.params)]

    def _accumulated(self, i: int, param: nn.Parameter) -> None:
        self._repair(i)
        self._arrived(i, self._sum_eager, in_order=True)

    def _sum_eager(self, bucket: Bucket) -> None:
        self._works.append(sum_piece(self._piece(bucket), self.group, self.divide_by,
                                     self.wire_dtype))

    def _repair(self, i: int) -> None:
        grad_into_view(self.flat.params[i], self.flat.views[i])

    def finish(self) -> list[Any]:
        """After the module's backward: the hooks removed, the buckets still short of a
        gradient summed (in order), and every sum started, un-waited."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for position in range(self._next, len(self.buckets)):
            for i in self._missing[position]:
                self._repair(i)
        self._missing = [set() for _ in self.buckets]
        self._arrived(-1, self._sum_eager, in_order=True)
        works, self._works = self._works, []
        return works
