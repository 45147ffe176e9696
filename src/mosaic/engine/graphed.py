"""One module's forward and backward as two CUDA graphs whose backward adds the parameter
gradients into their `.grad` buffers itself.

`torch.cuda.make_graphed_callables` returns parameter gradients from its backward graph to
autograd, which then runs one AccumulateGrad per parameter tensor on the host (a copy or an
add launched per tensor). A torch.profiler trace of a data-parallel CLIP `paper` step on
2 x H200 found the host, not the GPU, bounding the step: ~400 AccumulateGrad calls and ~800
copies per step for 12.7 ms of GPU work. Here the accumulation is captured inside the
backward graph instead (autograd's own AccumulateGrad, run once during capture into `.grad`
tensors that stay put: views of a flat buffer, comm.FlatGrads), so a replay leaves no
per-parameter work to the host, and the engine runs what the profiler times (one graph of the
module's forward and backward, gradients accumulated inside).

The parameters are not inputs of the autograd node that replays the graphs, so autograd
never sees them: the owner must keep every used parameter's `.grad` pointing at the tensor
it had at capture (FlatGrads.attach does, every step) and zero it between optimizer steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

WARMUP_ITERATIONS = 2
"""Eager fwd+bwd runs on the capture stream before capture (cuBLAS handles, allocator)."""


class InGraphGradModule:
    """`fn` replayed from CUDA graphs, the parameter gradients accumulated inside them.

    `attach(unused)` points each used parameter's `.grad` at its persistent tensor (and
    leaves the `unused` ones, which the warm-up left without a gradient, at None: the
    optimizer skips them, as it would eagerly); it is called again before every step.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], params: Sequence[nn.Parameter],
                 samples: Sequence[torch.Tensor], stream: torch.cuda.Stream,
                 attach: Callable[[list[nn.Parameter]], None]) -> None:
        self.fn = fn
        self.params = [p for p in params if p.requires_grad]
        self.static_inputs = tuple(samples)
        self.wants_grad = [x.requires_grad for x in self.static_inputs]
        self.unused = self._warm_up(stream)
        unused_ids = {id(p) for p in self.unused}
        self.used = [p for p in self.params if id(p) not in unused_ids]
        attach(self.unused)  # .grad = the persistent tensors the capture accumulates into
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward_graph, stream=stream):
            out = fn(*self.static_inputs)
        self.static_output = out
        self.differentiable = out.requires_grad
        self.static_grad_output = torch.zeros_like(out)
        if self.differentiable:
            for x in self.static_inputs:
                x.grad = None
            wrt = [x for x in self.static_inputs if x.requires_grad] + self.used
            with torch.cuda.graph(self.backward_graph, pool=self.forward_graph.pool(),
                                  stream=stream):
                torch.autograd.backward(out, self.static_grad_output, inputs=wrt)
        self.static_input_grads = [x.grad if x.requires_grad else None
                                   for x in self.static_inputs]
        # The anchor makes the replay node's output require grad when no input does (an
        # encoder fed raw data), so its backward, which holds the parameter updates, runs.
        self._anchor = torch.zeros((), device=out.device, requires_grad=True)

    def _warm_up(self, stream: torch.cuda.Stream) -> list[nn.Parameter]:
        saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_ITERATIONS):
                out = self.fn(*self.static_inputs)
                if not isinstance(out, torch.Tensor):
                    raise TypeError("a module graphed with its gradients returns one tensor, "
                                    f"not {type(out).__name__}")
                if out.requires_grad:
                    wrt = [x for x in self.static_inputs if x.requires_grad] + self.params
                    torch.autograd.backward(out, torch.zeros_like(out), inputs=wrt)
        torch.cuda.current_stream().wait_stream(stream)
        unused = [p for p in self.params if p.grad is None]
        for p, grad in zip(self.params, saved, strict=True):
            p.grad = grad
        for x in self.static_inputs:
            x.grad = None
        return unused

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
