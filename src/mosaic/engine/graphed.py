"""One module's forward and backward as two CUDA graphs that leave the parameter gradients
where the optimizer (and the all-reduce) reads them, with no per-parameter work on the host.

`torch.cuda.make_graphed_callables` returns parameter gradients from its backward graph to
autograd, which then runs one AccumulateGrad per parameter tensor on the host. A torch.profiler
trace of a data-parallel CLIP `paper` step on 2 x H200 found the host, not the GPU, bounding
the step (~400 AccumulateGrad calls and ~800 copies per step for 12.7 ms of GPU work). Here the
parameters are not inputs of the autograd node that replays the graphs, so autograd never
touches them; the backward graph itself leaves each gradient in one of three places (`mode`):

- "own": the graph's own output tensors (captured once, rewritten by every replay), which
  `attach()` points `.grad` at. No kernel beyond the backward's: what make_graphed_callables
  costs on the GPU. For modules that no collective reads as one buffer.
- "copy": one fused copy (`torch._foreach_copy_`) into views of a flat buffer
  (comm.FlatGrads), so a data-parallel module's gradients are all-reduced in one call; or,
  with a `reducer` (bucket_reduce.py), a copy per bucket as its gradients are produced, each
  bucket all-reduced inside the graph while the rest of the backward runs.
- "add": the same with `torch._foreach_add_`, for several backwards per optimizer step
  (gradient accumulation, micro-batches); the owner zeroes the buffer between steps.

In "own" mode the gradients live in the graphs' private memory pool, which the two graphs
share: the backward's outputs may sit where the forward graph keeps its temporaries, so the
next forward replay overwrites them. Nothing reads them then, except an update deferred under
that forward (update_gates.py): `grads_outlive_forward` captures the backward in a pool of
its own. (Measured on the H200, Unified-IO 2 `tiny` with its update delayed block by block:
without it every weight trained differently and the loss went NaN; with it, bit for bit.)

Measured on the H200 (CLIP `paper`, batch 16, 1 GPU): letting autograd's AccumulateGrad add
inside the graph instead (one add kernel per parameter tensor) cost 1.2 ms per step, 11%.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from mosaic.engine.bucket_reduce import InBackwardReduce

WARMUP_ITERATIONS = 2
"""Eager fwd+bwd runs before capture (cuBLAS handles, lazy initialisation)."""
MODES = ("own", "copy", "add")


class InGraphGradModule:
    """`fn` replayed from a forward and a backward CUDA graph; parameter gradients per `mode`
    (module doc). `views`: for "copy" and "add", each parameter's persistent gradient tensor,
    in the order of `params`. Parameters the warm-up leaves without a gradient are `unused`:
    their `.grad` stays None (the optimizer skips them, as it would eagerly).
    `grads_outlive_forward`: the backward graph gets a memory pool apart from the forward's,
    so the gradients it leaves survive the next forward replay (module doc). `reducer` ("copy"
    only): the backward graph also all-reduces the flat buffer, bucket by bucket as the
    gradients are produced (bucket_reduce.py)."""

    def __init__(self, fn: Any, params: Sequence[nn.Parameter], samples: Sequence[torch.Tensor],
                 stream: torch.cuda.Stream, mode: str = "own",
                 views: Sequence[torch.Tensor] | None = None, *,
                 grads_outlive_forward: bool = False,
                 reducer: InBackwardReduce | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; use one of {MODES}")
        if (views is None) != (mode == "own"):
            raise ValueError(f"mode={mode!r} {'takes no' if mode == 'own' else 'needs'} views")
        if reducer is not None and mode != "copy":
            raise ValueError(f"mode={mode!r}: a backward graph sums its gradients only where it "
                             "copies them whole each step ('copy')")
        self.fn, self.mode, self.reducer = fn, mode, reducer
        self.grads_outlive_forward = grads_outlive_forward or mode != "own"
        """Whether the gradients stay intact through the next forward replay ("copy" and
        "add" keep them in buffers outside the graphs)."""
        trainable = [(i, p) for i, p in enumerate(params) if p.requires_grad]
        self.static_inputs = tuple(samples)
        unused = self._warm_up([p for _, p in trainable])
        self.unused = [p for _, p in trainable if id(p) in unused]
        self.used = [p for _, p in trainable if id(p) not in unused]
        self.views = [views[i] for i, p in trainable if id(p) not in unused] if views else []
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        fresh_cublas_workspaces()
        with torch.cuda.graph(self.forward_graph, stream=stream):
            out = fn(*self.static_inputs)
        self.differentiable = out.requires_grad
        self.static_grad_output = torch.zeros_like(out)
        self.static_input_grads: list[torch.Tensor | None] = [None] * len(self.static_inputs)
        self.param_grads: list[torch.Tensor | None] = []
        if self.differentiable:
            pool = (torch.cuda.graph_pool_handle() if grads_outlive_forward
                    else self.forward_graph.pool())
            with torch.cuda.graph(self.backward_graph, pool=pool, stream=stream):
                self._capture_backward(out)
        # The output's storage only: its autograd graph would keep each parameter's
        # AccumulateGrad node alive, created on the capture stream, and eager autograd over the
        # same parameters on another stream (the bench's user programs) would then warn and
        # synchronise the two streams for every parameter.
        self.static_output = out.detach()
        # The anchor makes the replay node's output require grad when no input does (an
        # encoder fed raw data), so its backward, which holds the parameter gradients, runs.
        self._anchor = torch.zeros((), device=out.device, requires_grad=True)
        del out

    def _capture_backward(self, out: torch.Tensor) -> None:
        wants = [i for i, x in enumerate(self.static_inputs) if x.requires_grad]
        wrt = [self.static_inputs[i] for i in wants] + self.used
        summing = (self.reducer.captured(self.used) if self.reducer is not None
                   else contextlib.nullcontext())
        with summing:
            grads = torch.autograd.grad(out, wrt, self.static_grad_output, allow_unused=True)
        for i, g in zip(wants, grads, strict=False):
            self.static_input_grads[i] = g
        self.param_grads = list(grads[len(wants):])
        if self.mode == "own" or self.reducer is not None:  # the reducer copied them in
            return
        pairs = [(v, g) for v, g in zip(self.views, self.param_grads, strict=True) if g is not None]
        if pairs:
            views, grads_ = (list(t) for t in zip(*pairs, strict=True))
            (torch._foreach_copy_ if self.mode == "copy" else torch._foreach_add_)(views, grads_)

    def _warm_up(self, params: list[nn.Parameter]) -> set[int]:
        """Eager steps on a throwaway stream (as make_graphed_callables does: the capture
        stream's cuBLAS workspace must be allocated inside the graph's pool); the ids of
        the parameters that get no gradient."""
        wants = [x for x in self.static_inputs if x.requires_grad]
        got: set[int] = set()
        differentiable = False
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_ITERATIONS):
                out = self.fn(*self.static_inputs)
                if not isinstance(out, torch.Tensor):
                    raise TypeError("a module graphed with its gradients returns one tensor, "
                                    f"not {type(out).__name__}")
                if out.requires_grad:
                    differentiable = True
                    grads = torch.autograd.grad(out, wants + params, torch.zeros_like(out),
                                                allow_unused=True)
                    got |= {id(p) for p, g in zip(params, grads[len(wants):], strict=True)
                            if g is not None}
                    del grads  # else the next iteration's live beside them: one more copy
                del out
        torch.cuda.current_stream().wait_stream(side)
        return {id(p) for p in params} - got if differentiable else set()

    def attach(self) -> None:
        """Point each used parameter's `.grad` at the tensor the backward graph writes."""
        tensors = self.views if self.mode != "own" else self.param_grads
        for p, g in zip(self.used, tensors, strict=True):
            p.grad = g

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        if not self.differentiable:
            self._copy_inputs(args)
            self.forward_graph.replay()
            return self.static_output.detach()
        return _Replay.apply(self, self._anchor, *args)

    def _copy_inputs(self, args: Sequence[torch.Tensor]) -> None:
        if len(args) != len(self.static_inputs):
            raise TypeError(f"captured with {len(self.static_inputs)} inputs, called with "
                            f"{len(args)}")
        for static, x in zip(self.static_inputs, args, strict=True):
            if static.data_ptr() != x.data_ptr():
                static.copy_(x)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, owner: InGraphGradModule, anchor: torch.Tensor,
                *args: torch.Tensor) -> torch.Tensor:
        ctx.owner = owner
        owner._copy_inputs(args)
        owner.forward_graph.replay()
        return owner.static_output.detach()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        owner: InGraphGradModule = ctx.owner
        if grad_output is None:
            owner.static_grad_output.zero_()
        elif grad_output.data_ptr() != owner.static_grad_output.data_ptr():
            owner.static_grad_output.copy_(grad_output)
        owner.backward_graph.replay()
        grads = [g.detach() if g is not None else None for g in owner.static_input_grads]
        return (None, None, *grads)


def fresh_cublas_workspaces() -> None:
    """Drop torch's cached cuBLAS workspaces, so the capture that follows allocates its own
    inside the graph's private memory pool.

    A graph replays the workspace address it captured. Torch caches one workspace per
    (cuBLAS handle, stream) and frees it whenever the cache is cleared: Inductor's cudagraph
    trees clear it before every recording, and destroying a graph clears its stream's
    (pytorch/pytorch#193402). A graph that captured a cached workspace from ordinary memory
    then scribbles over whatever reuses that memory: with `torch.compile(mode="reduce-overhead")`
    beside mosaic's graphed plans, an "unspecified launch failure" in the next plan step. A
    workspace freed inside a live graph's private pool stays reserved to that pool, which
    takes no further captures.
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
