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
parameter order. A bucket is summed once every parameter it awaits has its gradient, and the
buckets are summed strictly in one order (by where their awaited parameters start, latest
first), so every rank issues the same collectives in the same order whatever order its
gradients arrive in. A parameter not awaited (one the module leaves unused) keeps a zero
view, summed with its bucket.

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
        self._grads: dict[int, torch.Tensor] = {}
        self._works: list[Any] = []
        self._handles: list[Any] = []
        on_gpu = bool(flat.params) and flat.params[0].is_cuda
        self._side = torch.cuda.Stream(flat.params[0].device) if on_gpu else None
        """The captured sums' stream, made before any capture (as the probe's)."""

    def _arm(self, buckets: list[Bucket]) -> None:
        self.buckets, self._next, self._works = buckets, 0, []
        self._missing = [set(b.awaited) for b in buckets]
        self._position = {i: k for k, b in enumerate(buckets) for i in b.awaited}

    def _arrived(self, i: int, sum_bucket: Callable[[Bucket], None]) -> None:
        position = self._position.get(i)
        if position is not None:
            self._missing[position].discard(i)
        while self._next < len(self.buckets) and not self._missing[self._next]:
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
        if side is None:
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
        if self._next != len(self.buckets):
            raise BucketReduceError(f"the captured backward left {len(self.buckets) - self._next}"
                                    f" of {len(self.buckets)} gradient buckets incomplete: a "
                                    "parameter used in the warm-up got no gradient; use "
                                    "grad_sync='flat'")
        if self.buckets:  # join the side stream only where a sum forked it into the capture
            torch.cuda.current_stream().wait_stream(side)

    def _received(self, i: int, side: torch.cuda.Stream, grad: torch.Tensor) -> None:
        self._grads[i] = grad
        self._arrived(i, partial(self._sum_captured, side))

    def _sum_captured(self, side: torch.cuda.Stream, bucket: Bucket) -> None:
        torch._foreach_copy_([self.flat.views[i] for i in bucket.awaited],
                             [self._grads.pop(i) for i in bucket.awaited])
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            sum_piece(self._piece(bucket), self.group, self.divide_by, self.wire_dtype,
                      async_op=False)

    # --- eager backward ------------------------------------------------------------------
    def start(self) -> None:
        """Before the module's backward: hooks on every parameter's gradient accumulation."""
        self._arm(self._every)
        self._handles = [p.register_post_accumulate_grad_hook(partial(self._accumulated, i))
                         for i, p in enumerate(self.flat.params)]

    def _accumulated(self, i: int, param: nn.Parameter) -> None:
        self._repair(i)
        self._arrived(i, self._sum_eager)

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
        self._arrived(-1, self._sum_eager)
        works, self._works = self._works, []
        return works
